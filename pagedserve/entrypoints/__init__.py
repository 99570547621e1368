"""Entry points: the CLI, the process launcher and the offline LLM API."""
