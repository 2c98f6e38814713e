"""``k3rl corpus build CONFIG [key=value …]``: build (or refresh) a corpus cache with a progress bar.

CONFIG is a YAML file of ``CorpusConfig`` fields, or the name of a built-in source
(``wiki``, ``shakespeare``). Overrides use dotted keys (``bm25.k1=0.9``,
``indexes=[bm25,dense]``; read by envs/corpus_config.py); an unknown key fails with the list of valid ones.
Exit codes: 0 built, 1 corpus error (missing or corrupt input), 2 bad usage.
"""

from __future__ import annotations

import sys
import time

USAGE = """usage: k3rl corpus build CONFIG [key=value ...] [--rebuild]

CONFIG   a YAML file of corpus settings, or a built-in source: wiki, shakespeare
key=value  override a setting, e.g. limit=2000 indexes=[bm25,dense] bm25.k1=0.9
--rebuild  ignore the cache and build everything again"""


def main(argv: list[str]) -> int:
    """Entry point for ``k3rl corpus …``; returns the exit code."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "build" or len(argv) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    rebuild = "--rebuild" in argv
    config_arg, *overrides = [a for a in argv[1:] if a != "--rebuild"]
    from k3rl.envs.corpus_config import read_config

    try:
        config = read_config(config_arg, overrides)
    except (ValueError, OSError) as exc:
        print(f"k3rl corpus build: {exc}", file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from k3rl.envs.corpus import CorpusError, corpus_dir, corpus_stats, load_corpus

    console = Console(stderr=True)
    started = time.perf_counter()
    columns = (TextColumn("{task.description:<15}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        try:
            corpus = load_corpus(config, progress=progress, rebuild=rebuild)
        except CorpusError as exc:
            console.print(f"[red]k3rl corpus build: {type(exc).__name__}: {exc}")
            return 1
    stats = corpus_stats(corpus)
    print(
        f"corpus {config.name}: {stats['documents']} documents, {stats['passages']} passages, "
        f"indexes {', '.join(corpus.methods)}; cache {corpus_dir(config)} ({time.perf_counter() - started:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
