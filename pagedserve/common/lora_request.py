"""vLLM's LoRARequest, which the offline LLM's generate() takes per prompt."""
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter to run a prompt with: its name, vLLM's integer id (unused here: adapters are
    named), and its PEFT directory, which must be the one LLM(lora_modules=...) loaded it from."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
