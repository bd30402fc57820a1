"""`ember list`: the known model aliases, their family, and whether each is on this machine."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from ember.loading.hub import ALIASES, DEFAULT_MODEL, is_present


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list known models and which are present locally", description=__doc__)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    table = Table(title="Ember models", title_justify="left")
    for column in ("alias", "family", "present", "source", "description"):
        table.add_column(column)
    for alias, spec in sorted(ALIASES.items()):
        present = is_present(spec)
        name = f"{alias} (default)" if alias == DEFAULT_MODEL else alias
        source = f"pip: {spec.packaged.split(':')[0]}" if spec.packaged else spec.repo_id
        table.add_row(name, spec.family, "yes" if present else "no", source, spec.description)
    Console(width=160).print(table)
    return 0
