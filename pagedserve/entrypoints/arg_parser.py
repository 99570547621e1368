"""The argument parser of every pagedserve command: no abbreviations, defaults in --help, errors
in one line that name the closest valid flag, and vLLM's `--config FILE`."""
import argparse
import difflib
import json
from pathlib import Path

import yaml

from pagedserve.common.config import UNBUILT_VLLM_FLAGS, flag_name

CONFIG_FLAG = "--config"


class Parser(argparse.ArgumentParser):
    """argparse with vLLM users' expectations; subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        # A prefix such as --gpu must not pass for --gpu-memory-utilization silently.
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if args is not None and CONFIG_FLAG in self._option_string_actions:
            args = self.with_config_file(list(args), namespace)
        namespace, extras = super().parse_known_args(args, namespace)
        # A parser with no subcommands below it is the last that could have taken them.
        if extras and self._subparsers is None:
            self.error(self.unrecognized(extras))
        return namespace, extras

    def unrecognized(self, extras: list[str]) -> str:
        flag = next((e for e in extras if e.startswith("-")), None)
        if flag is None:
            return f"unexpected argument {extras[0]!r}"
        flag = flag.split("=", 1)[0]
        # vLLM's -O takes its level attached (-O3).
        reason = UNBUILT_VLLM_FLAGS.get("--compilation-config" if flag.startswith("-O") else flag)
        if reason is not None:
            return f"{flag}: {reason}"
        close = closest(flag, [o for a in self._actions for o in a.option_strings])
        if close is None:
            return f"unrecognized argument {flag}; see {self.prog} --help"
        return f"unrecognized argument {flag}; did you mean {close}? (flags are not abbreviated)"

    def with_config_file(self, args: list[str], namespace: argparse.Namespace | None) -> list[str]:
        """`args` and, after them, the flags of its --config file that `args` does not give: the
        command line wins (vLLM's order: command line, then the file, then the defaults), and a
        model it names, as MODEL or --model, wins over the file's `model`."""
        path = config_path(args)
        if path is None:
            return args
        given = {self._option_string_actions[a.split("=", 1)[0]] for a in args
                 if a.split("=", 1)[0] in self._option_string_actions}
        positional = super().parse_known_args(args, argparse.Namespace(**vars(namespace or argparse.Namespace())))[0]
        if getattr(positional, "model_path", None):
            given.add(self._option_string_actions.get("--model"))
        try:
            return args + self.config_flags(path, given)
        except ValueError as e:
            self.error(str(e))

    def config_flags(self, path: str, skip: set[argparse.Action]) -> list[str]:
        """The flags that the YAML mapping in `path` stands for (its keys are long flag names
        without dashes), but those of the actions in `skip`; raises ValueError for a file that is no
        such mapping or an unknown key."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"{CONFIG_FLAG} {path} cannot be read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{CONFIG_FLAG} {path} is not YAML ({' '.join(str(e).split())})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{CONFIG_FLAG} {path} must hold a mapping of flag names to values, such as "
                             "`max-model-len: 8192`")
        argv = []
        for key, value in data.items():
            flag = flag_name(str(key))
            action = self._option_string_actions.get(flag)
            if action is None and flag in UNBUILT_VLLM_FLAGS:
                raise ValueError(f"{CONFIG_FLAG} {path}: {key}: {UNBUILT_VLLM_FLAGS[flag]}")
            if action is None or flag == CONFIG_FLAG:
                close = closest(flag, [o for a in self._actions for o in a.option_strings if o != CONFIG_FLAG])
                hint = f"; did you mean {close[2:]}?" if close else ""
                raise ValueError(f"{CONFIG_FLAG} {path}: unknown key {key!r}{hint} (keys are {self.prog}'s "
                                 "long flags without dashes)")
            if value is None:
                raise ValueError(f"{CONFIG_FLAG} {path}: {key!r} has no value")
            if action not in skip:
                argv += flag_argv(flag, value, action)
        return argv

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def closest(flag: str, options: list[str]) -> str | None:
    """The valid flag that `flag` most likely meant: the shortest one it begins, else the most similar."""
    starts = sorted((o for o in options if o.startswith(flag) and o.startswith("--")), key=len)
    if starts:
        return starts[0]
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
    return close[0] if close else None


def config_path(args: list[str]) -> str | None:
    """The file of the last --config in `args`, if any."""
    path = None
    for i, arg in enumerate(args):
        if arg == CONFIG_FLAG and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith(CONFIG_FLAG + "="):
            path = arg.split("=", 1)[1]
    return path


def flag_argv(flag: str, value: object, action: argparse.Action) -> list[str]:
    """A config file's value as the command line gives it: true as the bare flag, false as its
    --no- form where there is one (else the default stands), a list as a flag's several values
    (one flag each for a repeatable flag), a mapping or a list for a one-value flag as JSON."""
    if isinstance(value, bool):
        negated = "--no-" + flag[2:]
        return [flag] if value else [negated] if negated in action.option_strings else []
    if isinstance(value, list) and isinstance(action, argparse._AppendAction):
        return [f"{flag}={_text(v)}" for v in value]
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [flag, *map(_text, value)]
    return [f"{flag}={_text(value)}"]


def _text(value: object) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
