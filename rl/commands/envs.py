"""``k3rl envs``: print one line per registered environment (envs/registry.py `list_envs`)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    """Entry point for ``k3rl envs``; returns the exit code."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: k3rl envs\n\nList the registered environments, one line each.")
        return 0
    if argv:
        print(f"k3rl envs: unexpected arguments {argv}", file=sys.stderr)
        return 2
    from k3rl.envs.registry import list_envs

    entries = list_envs()
    width = max((len(e.name) for e in entries), default=0)
    for e in entries:
        print(f"{e.name:<{width}}  {e.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
