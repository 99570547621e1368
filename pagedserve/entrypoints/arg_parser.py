"""The argument parser of every pagedserve command: no abbreviations, defaults in --help, and
errors in one line that name the closest valid flag."""
import argparse
import difflib


class Parser(argparse.ArgumentParser):
    """argparse with vLLM users' expectations; subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        # A prefix such as --gpu must not pass for --gpu-memory-utilization silently.
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
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
        close = closest(flag, [o for a in self._actions for o in a.option_strings])
        if close is None:
            return f"unrecognized argument {flag}; see {self.prog} --help"
        return f"unrecognized argument {flag}; did you mean {close}? (flags are not abbreviated)"

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def closest(flag: str, options: list[str]) -> str | None:
    """The valid flag that `flag` most likely meant: the shortest one it begins, else the most similar."""
    starts = sorted((o for o in options if o.startswith(flag) and o.startswith("--")), key=len)
    if starts:
        return starts[0]
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
    return close[0] if close else None

