"""--also-serve MODEL[,key=value...]: one more model behind the gateway, for `serve` to start or for a
gateway to route to. Keys are flag names without their dashes (served-model-name=bge,
gpu-memory-utilization=0.2, scheduler-address=host:50051); a value may hold commas (a list of names
or addresses, a JSON object), since a comma begins the next key only where `key=` follows it."""
import re
from dataclasses import dataclass

_KEY = re.compile(r"[a-z][a-z0-9_-]*=")
_NEXT_KEY = re.compile(r",(?=[a-z][a-z0-9_-]*=)")
# Flags whose value is a list (nargs="+"): a comma-separated value gives its items.
_LIST_FLAGS = frozenset({"served-model-name"})


@dataclass(slots=True, frozen=True)
class AlsoServe:
    model: str
    # By flag name with dashes, in the order given.
    options: dict[str, str]

    def argv(self) -> list[str]:
        """The options as command-line flags: `true`/`false` turn a switch on or off."""
        argv = []
        for key, value in self.options.items():
            if key in _LIST_FLAGS:
                argv += [f"--{key}", *value.split(",")]
            elif value in ("true", "false"):
                argv.append(f"--{key}" if value == "true" else f"--no-{key}")
            else:
                argv.append(f"--{key}={value}")
        return argv


def parse(value: str) -> AlsoServe:
    """The model and options of one --also-serve; raises ValueError on an empty model or a key given twice."""
    model, *pairs = _NEXT_KEY.split(value)
    if not model or _KEY.match(model):
        raise ValueError(f"--also-serve {value!r} names no model; write MODEL[,key=value...]")
    options: dict[str, str] = {}
    for pair in pairs:
        key, option = pair.split("=", 1)
        key = key.replace("_", "-")
        if key in options:
            raise ValueError(f"--also-serve {value!r} gives {key} twice; list several values as {key}=A,B")
        options[key] = option
    return AlsoServe(model, options)
