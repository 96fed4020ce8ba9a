"""The ``keyshred`` command line.

User errors (a ``KeyshredError``: missing folder, bad config, server down) print one
line on stderr and exit 2, never a traceback; a failed drill exits 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from keyshred.config import Config, KekSettings
from keyshred.errors import KeyshredError
from keyshred.facade import Keyshred

__all__ = ["app", "main"]

app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="keyshred: erasable-by-design storage for AI-agent memory.",
)
keys_app = typer.Typer(no_args_is_help=True, help="KEK epochs and key-store maintenance.")
app.add_typer(keys_app, name="keys")

out = Console()

PathOpt = Annotated[
    Path,
    typer.Option("--path", "-p", envvar="KEYSHRED_PATH", help="The keyshred data folder."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def _emit(data: dict[str, Any], as_json: bool, text: str) -> None:
    if as_json:
        typer.echo(json.dumps(data, sort_keys=True, default=str))
    else:
        out.print(text)


@app.command()
def init(
    path: Annotated[Path, typer.Argument(help="Folder to create.")],
    kek: Annotated[str, typer.Option(help="KEK provider: local, vault or aws.")] = "local",
    tenant: Annotated[str, typer.Option(help="Default tenant.")] = "default",
    as_json: JsonOpt = False,
) -> None:
    """Create a data folder: configuration, KEK (local key file, 0600) and key store."""
    if kek not in {"local", "vault", "aws"}:
        raise KeyshredError(f"unknown KEK provider {kek!r}; choose local, vault or aws")
    config = Config(tenant=tenant, kek=KekSettings(provider=kek))
    with Keyshred.init(path, config) as ks:
        epoch = ks.keyring.kek.current_epoch()
    _emit(
        {"path": str(path), "kek": kek, "kek_epoch": epoch},
        as_json,
        f"initialized {path} (KEK provider {kek}, epoch {epoch})",
    )


@app.command()
def drill(
    path: Annotated[
        Path | None, typer.Option("--path", help="Keep the drill's data folder here.")
    ] = None,
    subjects: Annotated[int, typer.Option(min=2, help="Synthetic subjects.")] = 5,
    records: Annotated[int, typer.Option(min=1, help="Records per subject.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """Write a synthetic workload, erase one subject, and verify every path."""
    from keyshred.drill import run_drill

    if as_json:
        report = run_drill(path, subjects=subjects, records=records)
        typer.echo(json.dumps(report.to_json(), sort_keys=True))
    else:
        with out.status("drill") as status:
            report = run_drill(
                path,
                subjects=subjects,
                records=records,
                progress=lambda step: status.update(f"drill: {step}"),
            )
        table = Table(title=f"keyshred drill: erase subject_ref {report.erased_subject_ref}")
        table.add_column("check")
        table.add_column("result")
        table.add_column("ms", justify="right")
        table.add_column("detail")
        for c in report.checks:
            table.add_row(
                c.name,
                "[green]pass[/green]" if c.passed else "[red]FAIL[/red]",
                f"{c.seconds * 1000:.1f}",
                c.detail,
            )
        out.print(table)
        verdict = "[green]all checks passed[/green]" if report.passed else "[red]FAILED[/red]"
        out.print(f"{report.subjects} subjects, {report.records} records: {verdict}")
    if not report.passed:
        raise typer.Exit(1)


@keys_app.command("status")
def keys_status(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Show KEK epochs and key-store counts."""
    with Keyshred.open(path) as ks:
        epochs = ks.keyring.kek.epochs()
        counts = ks.keyring.store.counts()
        data = {
            "kek_provider": ks.keyring.kek.name,
            "current_epoch": ks.keyring.kek.current_epoch(),
            "epochs": [{"epoch": e.epoch, "created_at": e.created_at.isoformat()} for e in epochs],
            "keys": counts["dek"],
            "tombstones": counts["tombstone"],
        }
    _emit(
        data,
        as_json,
        f"KEK {data['kek_provider']} epoch {data['current_epoch']} "
        f"(live: {[e.epoch for e in epochs]}); {counts['dek']} keys, "
        f"{counts['tombstone']} tombstones",
    )


@keys_app.command("rotate-kek")
def keys_rotate(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Create a new KEK epoch and re-wrap every stored key under it (data untouched)."""
    with Keyshred.open(path) as ks:
        r = ks.keyring.rotate_kek()
    _emit(
        {"new_epoch": r.new_epoch, "keys_rewrapped": r.keys_rewrapped},
        as_json,
        f"KEK epoch {r.new_epoch}: {r.keys_rewrapped} keys re-wrapped",
    )


@keys_app.command("destroy-epochs")
def keys_destroy_epochs(
    before: Annotated[int, typer.Option(help="Destroy every epoch older than this one.")],
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Destroy old KEK epochs: key-store copies wrapped by them become useless."""
    with Keyshred.open(path) as ks:
        gone = ks.keyring.destroy_kek_epochs_before(before)
    _emit(
        {"destroyed": [{"epoch": d.epoch, "effective_at": d.effective_at} for d in gone]},
        as_json,
        f"destroyed epochs {[d.epoch for d in gone]}",
    )


def main() -> None:
    """Console entry point: user errors become one line and exit code 2."""
    try:
        app()
    except KeyshredError as exc:
        message = " ".join(str(exc).split())  # exactly one line, whatever the message
        sys.stderr.write(f"keyshred: error: {message}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
