"""`python -m pagedserve.entrypoints.openai.api_server --model DIR ...`: vLLM's older way to start
its server, the one many deployment guides use; the same as `pagedserve serve` with the same flags."""
import sys

from pagedserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
