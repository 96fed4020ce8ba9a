"""The ``keyshred`` command line.

User errors (a ``KeyshredError``: missing folder, bad config, server down) print one
line on stderr and exit 2, never a traceback; a failed drill exits 1.

Why one module of ~1,000 lines: Typer builds the command tree from the functions of
this module; each command is a thin wrapper (parse, call the facade, print), and the
shared error handling and printing live at the top.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from keyshred.config import load_config
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
receipt_app = typer.Typer(no_args_is_help=True, help="Erasure receipts.")
app.add_typer(receipt_app, name="receipt")
audit_app = typer.Typer(no_args_is_help=True, help="The hash-chained audit log.")
app.add_typer(audit_app, name="audit")
backup_app = typer.Typer(no_args_is_help=True, help="Backups: create, list, restore, prune.")
app.add_typer(backup_app, name="backup")
consent_app = typer.Typer(no_args_is_help=True, help="Consent records: grant, revoke, list.")
app.add_typer(consent_app, name="consent")
retention_app = typer.Typer(no_args_is_help=True, help="Retention: run the scanner, show settings.")
app.add_typer(retention_app, name="retention")
requests_app = typer.Typer(no_args_is_help=True, help="Erasure requests: list them.")
app.add_typer(requests_app, name="requests")
jobs_app = typer.Typer(no_args_is_help=True, help="Jobs in the catalog: list them.")
app.add_typer(jobs_app, name="jobs")
verify_app = typer.Typer(
    no_args_is_help=True, help="Checks anyone can run: residue of erased data in files."
)
app.add_typer(verify_app, name="verify")

out = Console()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"keyshred {version('keyshred')}")
        raise typer.Exit


@app.callback()
def _main(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """keyshred: erasable-by-design storage for AI-agent memory."""


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


def _refuse_conflict(
    setting: str, option: str, given: str | None, model: Any, *, show: bool = True
) -> None:
    """Refuse an option that contradicts a setting made in keyshred.toml or the
    environment (``KEYSHRED_...``). ``show=False`` for URLs, which may hold a password."""
    field = setting.rsplit(".", 1)[-1]
    configured = getattr(model, field)
    if given is not None and field in model.model_fields_set and given != configured:
        said = (
            f"{option} {given} contradicts {setting} = {configured!r}"
            if show
            else (f"{option} contradicts {setting}")
        )
        raise KeyshredError(
            f"{said} in keyshred.toml or the environment; change one of them "
            f"(or leave out {option})"
        )


@app.command()
def init(  # noqa: PLR0917 - typer maps every parameter to an argument or option
    path: Annotated[Path, typer.Argument(help="Folder to create.")],
    kek: Annotated[
        str | None,
        typer.Option(
            help="KEK provider: local, vault or aws (default: keyshred.toml's, or local)."
        ),
    ] = None,
    tenant: Annotated[
        str | None, typer.Option(help="Default tenant (default: keyshred.toml's, or default).")
    ] = None,
    catalog_url: Annotated[
        str | None,
        typer.Option(
            "--catalog-url", help="sqlite:///… or postgresql+psycopg://… (default: in the folder)."
        ),
    ] = None,
    backup_target: Annotated[
        str | None,
        typer.Option(
            "--backup-target", help="A folder or s3://bucket/prefix (default: in the folder)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a data folder: configuration, KEK (local key file, 0600) and key store."""
    from keyshred.config import BackupSettings, StorageSettings

    if kek is not None and kek not in {"local", "vault", "aws"}:
        raise KeyshredError(f"unknown KEK provider {kek!r}; choose local, vault or aws")
    config = load_config(path)  # keyshred.toml already there, or the environment
    # An option left out never overrides the file; one that contradicts it is refused
    # (a default 'local' once wrapped a shared key store's secrets with a local KEK).
    _refuse_conflict("kek.provider", "--kek", kek, config.kek)
    _refuse_conflict("tenant", "--tenant", tenant, config)
    _refuse_conflict(
        "storage.catalog_url", "--catalog-url", catalog_url, config.storage, show=False
    )
    _refuse_conflict("backup.target", "--backup-target", backup_target, config.backup, show=False)
    kek = kek or config.kek.provider
    config = config.model_copy(
        update={
            "tenant": tenant or config.tenant,
            "kek": config.kek.model_copy(update={"provider": kek}),
            "storage": StorageSettings(
                **{
                    **config.storage.model_dump(),
                    "catalog_url": catalog_url or config.storage.catalog_url,
                }
            ),
            "backup": BackupSettings(
                **{**config.backup.model_dump(), "target": backup_target or config.backup.target}
            ),
        }
    )
    with Keyshred.init(path, config) as ks:
        epoch = ks.keyring.kek.current_epoch()
    _emit(
        {"path": str(path), "kek": kek, "kek_epoch": epoch},
        as_json,
        f"initialized {path} (KEK provider {kek}, epoch {epoch})",
    )


@contextlib.contextmanager
def _drill_progress() -> Iterator[Any]:
    """Progress bars for the drill's long steps (workload, backup, restore) and a
    spinner line for each check, on stderr."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        tasks: dict[str, Any] = {}

        def update(step: str, done: int, total: int) -> None:
            if step not in tasks:
                tasks[step] = bar.add_task(step, total=total or None)
            if total:
                bar.update(tasks[step], completed=done, total=total)

        yield update


@app.command()
def drill(  # noqa: PLR0917 - typer maps every parameter to an argument or option
    path: Annotated[
        Path | None, typer.Option("--path", help="Keep the drill's data folder here.")
    ] = None,
    subjects: Annotated[int, typer.Option("--subjects", min=3, help="Synthetic subjects.")] = 5,
    records: Annotated[
        int, typer.Option("--memories", "--records", min=2, help="Memories per subject.")
    ] = 20,
    receipt_dir: Annotated[
        Path, typer.Option("--receipt-dir", help="Where the receipt is kept (no --path).")
    ] = Path("."),
    profile: Annotated[
        str,
        typer.Option(
            "--profile",
            help="embedded (one process, no server) or shared (starts OpenBao and moto, "
            "uses PostgreSQL, erases through worker processes and kills one mid-erasure).",
        ),
    ] = "embedded",
    postgres_url: Annotated[
        str | None,
        typer.Option(
            "--postgres-url",
            help="shared: the PostgreSQL to use, in a fresh schema dropped afterwards "
            "(default postgresql+psycopg://postgres@127.0.0.1:5432/test).",
        ),
    ] = None,
    workers: Annotated[
        int, typer.Option("--workers", min=2, help="shared: worker processes (one is killed).")
    ] = 3,
    record_in: Annotated[
        Path | None,
        typer.Option(
            "--record-in",
            help="Record the report in this data folder's audit chain (a service's "
            "store: its console shows the latest drill).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a synthetic workload, erase one subject, and verify every path."""
    from keyshred.drill import DrillReport, record_report, run_drill

    if profile not in {"embedded", "shared"}:
        raise KeyshredError(f"unknown drill profile {profile!r}; choose embedded or shared")
    if profile == "embedded" and postgres_url is not None:
        raise KeyshredError("--postgres-url is for --profile shared")
    if profile == "shared" and path is not None:
        raise KeyshredError(
            "--path is for --profile embedded (the shared drill's folders are temporary)"
        )

    def run(progress: Any = None) -> DrillReport:
        extra = {} if progress is None else {"progress": progress}
        if profile == "shared":
            from keyshred.drill_shared import DEFAULT_POSTGRES_URL, run_shared_drill

            return run_shared_drill(
                postgres_url or DEFAULT_POSTGRES_URL,
                workers=workers,
                subjects=subjects,
                records=records,
                receipt_dir=receipt_dir,
                **extra,
            )
        return run_drill(path, subjects=subjects, records=records, receipt_dir=receipt_dir, **extra)

    if record_in is not None:
        Keyshred.open(record_in).close()  # checked first: a drill takes a while

    if as_json:
        report = run()
    else:
        with _drill_progress() as progress:
            report = run(progress)
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
        out.print(f"{report.subjects} subjects, {report.records} memories: {verdict}")
        if report.receipt_file:
            out.print(f"signed receipt: {report.receipt_file}")
    if record_in is not None:
        with Keyshred.open(record_in) as ks:
            record_report(ks, report, profile=profile)
    if as_json:
        typer.echo(json.dumps(report.to_json(), sort_keys=True))
    if not report.passed:
        raise typer.Exit(1)


@keys_app.command("status")
def keys_status(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Show KEK epochs (when the live one is due, and whether that is overdue) and
    key-store counts."""
    with Keyshred.open(path) as ks:
        epochs = ks.keyring.kek.epochs()
        counts = ks.keyring.store.counts()
        live = ks.backup.live_status()
        flush_failed = ks.audit.events(event="vault.flush_failed")  # any process's
        data = {
            "kek_provider": ks.keyring.kek.name,
            "current_epoch": ks.keyring.kek.current_epoch(),
            "epochs": [{"epoch": e.epoch, "created_at": e.created_at.isoformat()} for e in epochs],
            "live": live.as_dict(),
            "keys": counts["dek"],
            "tombstones": counts["tombstone"],
            "token_flush": {
                **ks.vault.status().as_dict(),
                "failure_runs_audited": len(flush_failed),
                "last_audited_failure_at": (
                    flush_failed[-1].at.isoformat() if flush_failed else None
                ),
            },
        }
    _emit(
        data,
        as_json,
        f"KEK {data['kek_provider']} epoch {data['current_epoch']} "
        f"(live: {[e.epoch for e in epochs]}); live epoch {live.epoch} due "
        f"{live.due_at.isoformat()}"
        + (" [OVERDUE: run 'keyshred maintain']" if live.overdue else "")
        + f"; {counts['dek']} keys, "
        f"{counts['tombstone']} tombstones; token flush failures: {len(flush_failed)} "
        f"run(s) audited"
        + (f", last at {flush_failed[-1].at.isoformat()}" if flush_failed else ""),
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
    force: Annotated[
        bool, typer.Option("--force", help="Even if unexpired backups need them (audited).")
    ] = False,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Destroy old KEK epochs: key-store copies wrapped by them become useless.
    Refused while an unexpired backup generation is sealed under one (see --force)."""
    with Keyshred.open(path) as ks:
        gone = ks.destroy_kek_epochs_before(before, force=force)
    _emit(
        {"destroyed": [{"epoch": d.epoch, "effective_at": d.effective_at} for d in gone]},
        as_json,
        f"destroyed epochs {[d.epoch for d in gone]}",
    )


def _request_json(req: Any) -> dict[str, Any]:
    return {
        "request_id": req.request_id,
        "subject_ref": req.subject_ref,
        "scope": req.scope,
        "state": req.state,
        "steps_done": req.steps_done,
        "attempts": req.attempts,
        "error": req.error,
        "found_data": req.found_data,
    }


def _request_text(req: Any) -> str:
    text = f"request {req.request_id}: {req.state}" + (f" ({req.error})" if req.error else "")
    if req.found_data is False:
        text += "; no data found for this subject"
        if req.state == "completed":
            text += (
                " (the id stays erased: --block)"
                if req.doc.get("block")
                else " (the id stays free for new data)"
            )
    return text


@app.command()
def erase(  # noqa: PLR0917 - typer maps every parameter to an option
    subject: Annotated[str, typer.Argument(help="The subject id (never printed back).")],
    requested_by: Annotated[str, typer.Option("--requested-by", help="Who asked.")],
    reason: Annotated[str, typer.Option(help="Why, as a short code (e.g. gdpr-art17).")],
    scope: Annotated[str | None, typer.Option(help="Erase only this scope.")] = None,
    request_id: Annotated[str | None, typer.Option("--request-id")] = None,
    block: Annotated[
        bool,
        typer.Option(
            "--block",
            help="Keep the id erased (refusing new data) even if nothing of it was found.",
        ),
    ] = False,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Erase a subject (or one scope): suppress, destroy keys, drop, rebuild, verify."""
    with Keyshred.open(path) as ks:
        req = ks.erase(
            subject,
            scope,
            requested_by=requested_by,
            reason=reason,
            request_id=request_id,
            block=block,
        )
    _emit(_request_json(req), as_json, _request_text(req))
    if req.state not in ("completed", "legal_hold"):
        raise typer.Exit(1)


@app.command()
def status(
    request_id: Annotated[str, typer.Argument()],
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Show an erasure request's state and the steps it has done."""
    with Keyshred.open(path) as ks:
        req = ks.erasure.status(request_id)
    data = _request_json(req)
    _emit(data, as_json, f"{req.request_id}: {req.state}; done: {', '.join(req.steps_done)}")


@app.command()
def resume(
    request_id: Annotated[str, typer.Argument()],
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Continue a request that stopped (a crash, a failed step, a released hold)."""
    with Keyshred.open(path) as ks:
        req = ks.erasure.resume(request_id)
    _emit(_request_json(req), as_json, _request_text(req))
    if req.state not in ("completed", "legal_hold"):
        raise typer.Exit(1)


@receipt_app.command("show")
def receipt_show(
    request_id: Annotated[str, typer.Argument()],
    path: PathOpt = Path("."),
    as_json: Annotated[
        bool,
        typer.Option("--json", help="A JSON document: form, kid, the JWS and the fields."),
    ] = False,
) -> None:
    """Print the signed receipt of a completed request as issued: a compact JWS
    (verify it with 'keyshred receipt verify' or any JOSE library against 'keyshred
    keys jwks'), or the JSON document of a receipt issued before receipts were JWS.
    Save it to verify it later."""
    with Keyshred.open(path) as ks:
        receipt = ks.erasure.receipt(request_id)
    if receipt is None:
        raise KeyshredError(f"request {request_id} has no receipt yet")
    if not as_json:
        typer.echo(receipt.serialize())
        return
    doc = {
        "form": receipt.form,
        "kid": receipt.kid,
        "jws": receipt.jws,
        "receipt": json.loads(receipt.to_json()),
    }
    typer.echo(json.dumps(doc, indent=2, sort_keys=True))


def _trusted_keys(
    path: Path | None, public_key: str | None, key_file: Path | None, jwks_file: Path | None
) -> bytes | dict[str, Any]:
    """The keys a receipt must be signed by; a key inside the receipt proves nothing
    (anyone can re-sign an edited receipt with a fresh key)."""
    import base64

    given = [g for g in (path, public_key, key_file, jwks_file) if g is not None]
    if len(given) != 1:
        raise KeyshredError(
            "give the keys to trust, exactly one of: --path DATA (the store that signed "
            "it), --jwks FILE (from 'keyshred keys jwks'), --public-key KEY or "
            "--public-key-file FILE (from 'keyshred keys public-key')"
        )
    if path is not None:
        with Keyshred.open(path) as ks:
            return ks.receipts_jwks()
    if jwks_file is not None:
        try:
            jwks = json.loads(jwks_file.read_text("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise KeyshredError(f"cannot read a JWKS document from {jwks_file}") from None
        if not isinstance(jwks, dict):
            raise KeyshredError(f"{jwks_file} is not a JWKS document")
        return jwks
    if key_file is not None:
        try:
            public_key = key_file.read_text("utf-8").strip()
        except (OSError, UnicodeDecodeError):
            raise KeyshredError(f"cannot read {key_file}") from None
    try:
        return base64.b64decode(public_key or "", validate=True)
    except ValueError:
        raise KeyshredError("the trusted public key is not base64") from None


def _receipt_text(text: str) -> str:
    """What 'receipt show' printed: the JWS or old JSON receipt as issued, or (with
    --json) the document around it."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return text  # a compact JWS
    if isinstance(doc, dict) and set(doc) == {"form", "kid", "jws", "receipt"}:
        return doc["jws"] if isinstance(doc["jws"], str) else json.dumps(doc["receipt"])
    return text


@receipt_app.command("verify")
def receipt_verify(  # noqa: PLR0917 - typer maps every parameter to an argument or option
    file: Annotated[Path, typer.Argument(help="A receipt: its JWS or (older) JSON form.")],
    path: Annotated[
        Path | None, typer.Option("--path", "-p", help="Trust this data folder's signing keys.")
    ] = None,
    jwks_file: Annotated[
        Path | None, typer.Option("--jwks", help="Trust the keys of this JWKS document.")
    ] = None,
    public_key: Annotated[
        str | None, typer.Option("--public-key", help="Trust this signer (base64).")
    ] = None,
    key_file: Annotated[
        Path | None, typer.Option("--public-key-file", help="Trust the signer in this file.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Verify a receipt offline, in either form (a JWS, or the JSON form of receipts
    issued before): intact and signed by a key you trust (exit 1 if not)."""
    from keyshred.errors import IntegrityError, InvalidInput
    from keyshred.receipts import verify_receipt_text

    try:
        text = file.read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        raise KeyshredError(f"cannot read {file}") from None
    trusted = _trusted_keys(path, public_key, key_file, jwks_file)
    try:
        receipt = verify_receipt_text(_receipt_text(text), trusted)
    except InvalidInput as exc:
        raise KeyshredError(f"the trusted keys are not Ed25519 public keys: {exc}") from None
    except IntegrityError as exc:
        _emit({"valid": False, "error": str(exc)}, as_json, f"[red]receipt NOT valid[/red]: {exc}")
        raise typer.Exit(1) from None
    _emit(
        {
            "valid": True,
            "form": receipt.form,
            "kid": receipt.kid,
            "request_id": receipt.request_id,
            "subject_ref": receipt.subject_ref,
        },
        as_json,
        f"receipt {receipt.request_id} is valid ({receipt.form} form, key {receipt.kid})",
    )


@audit_app.command("verify")
def audit_verify(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Check the audit log's hash chain: edits, removals and reorders are found."""
    with Keyshred.open(path) as ks:
        n = ks.audit.verify()
    _emit({"valid": True, "events": n}, as_json, f"audit chain intact ({n} events)")


@audit_app.command("prune")
def audit_prune(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Delete audit events older than audit.retention_days (the chain stays verifiable)."""
    with Keyshred.open(path) as ks:
        n = ks.audit.apply_retention()
        days = ks.audit.retention_days
    _emit(
        {"pruned": n, "retention_days": days}, as_json, f"pruned {n} events older than {days} days"
    )


@app.command()
def metrics(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Print the store's metrics (requests by state, erasure completion times, audit
    events, keys, tokens), read from the catalog and the key store, in Prometheus
    text format (or as JSON samples)."""
    from keyshred.store_metrics import StoreMetrics

    with Keyshred.open(path) as ks:
        metrics = StoreMetrics(ks.catalog, ks.keyring.store, ks.jobs.queue)
        if as_json:
            typer.echo(json.dumps({"samples": metrics.samples()}, sort_keys=True))
        else:
            typer.echo(metrics.render(), nl=False)


class _Collectors:
    """Several registries' families as one collector (one metrics endpoint)."""

    def __init__(self, *registries: Any) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Any]:
        for registry in self._registries:
            yield from registry.collect()


def _serve_metrics(ks: Keyshred, port: int) -> Any:
    """Serve this process's metrics and the store's on 127.0.0.1:``port``."""
    from prometheus_client import CollectorRegistry, start_http_server

    from keyshred.store_metrics import StoreMetrics

    store = StoreMetrics(ks.catalog, ks.keyring.store, ks.jobs.queue)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collectors(ks.metrics.registry, store.registry))
    try:
        return start_http_server(port, addr="127.0.0.1", registry=registry)
    except OSError as exc:
        raise KeyshredError(f"cannot serve metrics on 127.0.0.1:{port}: {exc.strerror}") from None


@app.command()
def worker(
    path: PathOpt = Path("."),
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, help="Jobs run at once (1 on SQLite).")
    ] = 1,
    once: Annotated[bool, typer.Option("--once", help="Run the jobs due now, then exit.")] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", help="Serve Prometheus metrics on 127.0.0.1:PORT."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run jobs (erasure requests, retention, backup maintenance) until stopped.
    SIGTERM or SIGINT finishes the erasure step in progress, then exits 0; the
    request is left for the next worker."""
    import signal
    import threading

    from keyshred.worker import Worker

    stop = threading.Event()
    with Keyshred.open(path) as ks:
        runner = Worker(ks, concurrency=concurrency)
        served = None if metrics_port is None else _serve_metrics(ks, metrics_port)
        try:
            if once:
                ran = runner.run_once(stop)
            else:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, lambda *_: stop.set())
                typer.echo("worker running", err=True)
                runner.run(stop)
                ran = runner.ran
        finally:
            if isinstance(served, tuple):
                served[0].shutdown()
    _emit({"ran": ran}, as_json, f"worker stopped: {ran} job(s) run")


@app.command()
def serve(  # noqa: PLR0917 - typer maps every parameter to an option
    path: PathOpt = Path("."),
    api_config: Annotated[
        Path | None,
        typer.Option(
            "--api-config",
            envvar="KEYSHRED_API_CONFIG",
            help="The API settings (TOML: API key hashes, OIDC, rate limits).",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8080,
    workers: Annotated[
        int,
        typer.Option(
            "--workers", min=1, help="uvicorn worker processes (1 on the embedded profile)."
        ),
    ] = 1,
    allow_remote: Annotated[
        bool,
        typer.Option("--allow-remote", help="Listen on a non-loopback address (behind TLS)."),
    ] = False,
    no_access_log: Annotated[
        bool, typer.Option("--no-access-log", help="Do not print an access log line per call.")
    ] = False,
) -> None:
    """Serve the HTTP API (erasure, consent and access requests; receipts) under
    uvicorn until stopped. It records requests; workers run them (keyshred worker)."""
    from keyshred.api.server import serve as run

    run(
        path,
        config=api_config,
        host=host,
        port=port,
        workers=workers,
        allow_remote=allow_remote,
        access_log=not no_access_log,
    )


def _known_states(given: list[str] | None, known: tuple[str, ...]) -> None:
    """A misspelt ``--state`` is an error, not an empty list."""
    unknown = sorted(set(given or ()) - set(known))
    if unknown:
        raise typer.BadParameter(
            f"unknown state {', '.join(unknown)}; one of {', '.join(known)}",
            param_hint="--state",
        )


def _current_step(req: Any, steps: tuple[str, ...]) -> str | None:
    """The step a request is at: the first not done (None once completed)."""
    if req.state == "completed":
        return None
    return next((s for s in steps if s not in req.steps_done), None)


@requests_app.command("list")
def requests_list(
    state: Annotated[
        list[str] | None, typer.Option("--state", help="Only these states (repeat).")
    ] = None,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Erasure requests (oldest first): id, subject_ref, state, step, attempts,
    last update and their job's state. Stuck ones: --state propagating."""
    from keyshred.erasure.coordinator import job_key
    from keyshred.erasure.requests import REQUEST_STATES

    _known_states(state, REQUEST_STATES)
    with Keyshred.open(path) as ks:
        reqs = [r for r in ks.erasure.requests() if not state or r.state in state]
        jobs = ks.jobs.queue.by_keys([job_key(r.request_id) for r in reqs])
        steps = ks.erasure.steps
    rows: list[dict[str, Any]] = []
    for r in reqs:
        job = jobs.get(job_key(r.request_id))
        rows.append(
            {
                "request_id": r.request_id,
                "subject_ref": r.subject_ref,
                "scope": r.scope,
                "state": r.state,
                "step": _current_step(r, steps),
                "attempts": r.attempts,
                "updated_at": r.updated_at.isoformat(),
                "job_state": None if job is None else job.state,
                "job_attempts": None if job is None else job.attempts,
            }
        )
    if as_json:
        typer.echo(json.dumps({"requests": rows}, sort_keys=True))
        return
    table = Table(title="erasure requests")
    for col in ("request", "subject_ref", "state", "step", "attempts", "updated", "job"):
        table.add_column(col)
    for row in rows:
        table.add_row(
            row["request_id"],
            row["subject_ref"],
            row["state"],
            row["step"] or "-",
            str(row["attempts"]),
            row["updated_at"],
            row["job_state"] or "-",
        )
    out.print(table)


@jobs_app.command("list")
def jobs_list(
    state: Annotated[
        list[str] | None, typer.Option("--state", help="Only these states (repeat).")
    ] = None,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Jobs (oldest first): id, kind, state, attempts, last error, payload (ids)."""
    from dataclasses import asdict

    from keyshred.jobs import STATES

    _known_states(state, STATES)
    with Keyshred.open(path) as ks:
        found = ks.jobs.queue.list(state or None)
        depth = ks.jobs.queue.depth()
    if as_json:
        typer.echo(json.dumps({"jobs": [asdict(j) for j in found], "depth": depth}, sort_keys=True))
        return
    table = Table(title="jobs " + ", ".join(f"{k}: {n}" for k, n in depth.items()))
    for col in ("job", "kind", "state", "attempts", "last error", "payload"):
        table.add_column(col)
    for j in found:
        table.add_row(
            j.job_id,
            j.kind,
            j.state,
            f"{j.attempts}/{j.max_attempts}",
            j.last_error or "-",
            json.dumps(j.payload, sort_keys=True),
        )
    out.print(table)


@keys_app.command("public-key")
def keys_public_key(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """The current receipt signing key's public half (base64), to pin in verifiers
    ('keyshred keys jwks' lists every signing key, rotated ones included)."""
    import base64

    from keyshred.jose import jwk_thumbprint

    with Keyshred.open(path) as ks:
        raw = ks.keyring.receipt_signer().public_key
    key = base64.b64encode(raw).decode()
    _emit({"public_key": key, "kid": jwk_thumbprint(raw)}, as_json, key)


@keys_app.command("jwks")
def keys_jwks(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """The receipt signing keys as a JWKS document (RFC 7517; OKP/Ed25519, kid the
    RFC 7638 thumbprint): every key that signed a receipt kept here. Publish it;
    any JOSE library verifies the receipts against it. JSON either way (--json:
    on one line)."""
    with Keyshred.open(path) as ks:
        doc = ks.receipts_jwks()
    typer.echo(json.dumps(doc, sort_keys=True) if as_json else json.dumps(doc, indent=2))


@keys_app.command("rotate-signing-key")
def keys_rotate_signing_key(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Make a new receipt signing key; receipts from now on are signed by it. The
    older keys stay in the JWKS, so the receipts they signed keep verifying."""
    from keyshred.jose import jwk_thumbprint

    with Keyshred.open(path) as ks:
        kid = jwk_thumbprint(ks.keyring.rotate_receipt_signer().public_key)
        count = len(ks.receipts_jwks()["keys"])
    _emit({"kid": kid, "keys": count}, as_json, f"receipts are now signed by key {kid}")


SubjectArg = Annotated[str, typer.Argument(help="The subject id (never printed back).")]
NamespaceArg = Annotated[str, typer.Argument(help="Namespace labels separated by '/'.")]


def _ns(namespace: str) -> tuple[str, ...]:
    labels = tuple(p for p in namespace.split("/") if p)
    if not labels:
        raise KeyshredError("a namespace has at least one label (a/b/c)")
    return labels


def _memory_json(m: Any) -> dict[str, Any]:
    return {
        "memory_id": m.memory_id,
        "namespace": list(m.namespace),
        "key": m.key,
        "value": m.value,
        "scope": m.scope,
        "created_at": m.created_at.isoformat(),
        "updated_at": m.updated_at.isoformat(),
        "retain_until": m.retain_until.isoformat(),
        "score": m.score,
    }


@app.command()
def put(  # noqa: PLR0917 - typer maps every parameter to an argument or option
    subject: SubjectArg,
    namespace: NamespaceArg,
    key: Annotated[str, typer.Argument()],
    value: Annotated[str, typer.Argument(help="The value, as JSON.")],
    scope: Annotated[str, typer.Option(help="The scope (purpose) it is stored under.")] = "default",
    category: Annotated[str | None, typer.Option(help="The data category.")] = None,
    index: Annotated[bool, typer.Option(help="Embed the value for semantic search.")] = False,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Store one memory of a subject (quick inspection; applications use the API)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise KeyshredError("the value is not JSON (quote strings: '\"text\"')") from None
    with Keyshred.open(path) as ks:
        m = ks.memories.put(
            subject, _ns(namespace), key, parsed, scope=scope, category=category, index=index
        )
        data = _memory_json(m)
    _emit(data, as_json, f"stored memory {m.memory_id} (retained until {data['retain_until']})")


@app.command()
def get(
    subject: SubjectArg,
    namespace: NamespaceArg,
    key: Annotated[str, typer.Argument()],
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Print one memory of a subject (exit 2 if there is none)."""
    from keyshred.errors import NotFound

    with Keyshred.open(path) as ks:
        m = ks.memories.get(subject, _ns(namespace), key)
        if m is None:
            raise NotFound("no memory at that namespace and key for this subject")
        data = _memory_json(m)
    _emit(data, as_json, json.dumps(data["value"], ensure_ascii=False))


@app.command()
def search(  # noqa: PLR0917 - typer maps every parameter to an argument or option
    subject: SubjectArg,
    namespace: Annotated[str, typer.Argument(help="Namespace prefix ('' for all).")] = "",
    query: Annotated[str | None, typer.Option(help="Search by meaning (indexed memories).")] = None,
    limit: Annotated[int, typer.Option(min=1)] = 10,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Search a subject's memories under a namespace prefix, newest first or by meaning."""
    prefix = tuple(p for p in namespace.split("/") if p)
    with Keyshred.open(path) as ks:
        hits = ks.memories.search(subject, prefix, query=query, limit=limit)
        data = {"results": [_memory_json(m) for m in hits]}
    if as_json:
        typer.echo(json.dumps(data, sort_keys=True, default=str))
        return
    for m in data["results"]:
        score = "" if m["score"] is None else f" ({m['score']:.3f})"
        out.print(f"{'/'.join(m['namespace'])}/{m['key']}{score}: {json.dumps(m['value'])}")


def _consent_json(c: Any) -> dict[str, Any]:
    return {
        "consent_id": c.consent_id,
        "purpose": c.purpose,
        "category": c.category,
        "actions": list(c.actions),
        "start_at": c.start_at.isoformat(),
        "end_at": None if c.end_at is None else c.end_at.isoformat(),
        "policy_version": c.policy_version,
        "status": c.status,
        "revoked_at": None if c.revoked_at is None else c.revoked_at.isoformat(),
    }


@consent_app.command("grant")
def consent_grant(  # noqa: PLR0917 - typer maps every parameter to an argument or option
    subject: SubjectArg,
    scope: Annotated[str, typer.Option(help="The scope whose purpose is consented to.")],
    category: Annotated[str | None, typer.Option(help="One of the scope's categories.")] = None,
    days: Annotated[int | None, typer.Option(help="Consent ends after this many days.")] = None,
    policy_version: Annotated[str, typer.Option("--policy-version")] = "1",
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Record a subject's consent for a scope's purpose and a category."""
    from datetime import UTC, datetime, timedelta

    end = None if days is None else datetime.now(UTC) + timedelta(days=days)
    with Keyshred.open(path) as ks:
        c = ks.consent.grant(
            subject, scope=scope, category=category, end_at=end, policy_version=policy_version
        )
    _emit(_consent_json(c), as_json, f"consent {c.consent_id}: {c.purpose}/{c.category} granted")


@consent_app.command("revoke")
def consent_revoke(
    subject: SubjectArg,
    scope: Annotated[str, typer.Option(help="The scope whose consent is withdrawn.")],
    category: Annotated[str | None, typer.Option(help="One of the scope's categories.")] = None,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Withdraw consent: new writes for that purpose and category fail from now on."""
    with Keyshred.open(path) as ks:
        n = ks.consent.revoke(subject, scope=scope, category=category)
    _emit({"revoked": n}, as_json, f"{n} consent record(s) revoked")


@consent_app.command("list")
def consent_list(subject: SubjectArg, path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """A subject's consent records, with their history."""
    with Keyshred.open(path) as ks:
        records = ks.consent.list(subject)
    data = {"consents": [_consent_json(c) for c in records]}
    if as_json:
        typer.echo(json.dumps(data, sort_keys=True))
        return
    for c in data["consents"]:
        out.print(
            f"{c['consent_id']} {c['purpose']}/{c['category']} {c['status']} from {c['start_at']}"
        )


@consent_app.command("withdraw")
def consent_withdraw(
    subject: SubjectArg,
    scope: Annotated[str, typer.Option(help="The scope whose consent is withdrawn.")],
    category: Annotated[str | None, typer.Option(help="One of the scope's categories.")] = None,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Withdraw consent and erase the scope (reads and writes stop at once; the
    scope key is destroyed; a signed receipt). Other scopes stay."""
    with Keyshred.open(path) as ks:
        req = ks.consent.withdraw(subject, scope, category=category)
    _emit(_request_json(req), as_json, f"request {req.request_id}: {req.state}")
    if req.state not in ("completed", "legal_hold"):
        raise typer.Exit(1)


@retention_app.command("run")
def retention_run(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Find memories past their retain-until (plaintext metadata only, DuckDB over
    the partitions and the catalog) and erase exactly those, with receipts; purge
    expired tokens, exports, audit events and backup generations."""
    with Keyshred.open(path) as ks:
        report = ks.retention.run()
    _emit(
        report.as_dict(),
        as_json,
        f"{report.expired_memories} expired memories of {report.subjects} subjects "
        f"({report.held} on legal hold); {report.tokens_deleted} tokens, "
        f"{report.exports_expired} exports, {report.audit_events_pruned} audit events, "
        f"{len(report.backup_generations_pruned)} backup generations removed "
        f"(scan {report.scan_seconds * 1000:.0f} ms)",
    )


@retention_app.command("show")
def retention_show(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Retention per layer (memories, vectors, tokens, checkpoints, audit, backups)."""
    with Keyshred.open(path) as ks:
        shown = ks.retention.show()
    if as_json:
        typer.echo(json.dumps(shown, sort_keys=True, default=str))
        return
    table = Table(title="retention")
    table.add_column("layer")
    table.add_column("rule")
    for layer, rule in shown.items():
        table.add_row(layer, json.dumps(rule, default=str))
    out.print(table)


@app.command("export")
def export_cmd(  # noqa: PLR0917 - typer maps every parameter to an argument or option
    subject: SubjectArg,
    out_file: Annotated[Path, typer.Option("--out", help="The package file to write (new).")],
    passphrase_env: Annotated[
        str | None,
        typer.Option(
            "--passphrase-env", help="Name of the environment variable with the passphrase."
        ),
    ] = None,
    public_key: Annotated[
        str | None, typer.Option("--public-key", help="The recipient's X25519 public key (base64).")
    ] = None,
    days: Annotated[int, typer.Option(min=1, max=90, help="Days until the package expires.")] = 7,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Export a subject's data (access / portability request) as a sealed package."""
    import os
    from datetime import timedelta

    passphrase = None
    if passphrase_env is not None:
        passphrase = os.environ.get(passphrase_env)
        if not passphrase:
            raise KeyshredError(f"the environment variable {passphrase_env} is not set")
    with Keyshred.open(path) as ks:
        result = ks.export(
            subject,
            out_file,
            passphrase=passphrase,
            recipient_public_key=public_key,
            expires_in=timedelta(days=days),
        )
    _emit(
        result.as_dict(),
        as_json,
        f"export {result.export_id} written to {result.path}, expires {result.expires_at:%Y-%m-%d}",
    )


TargetOpt = Annotated[
    str | None,
    typer.Option("--target", help="A folder or s3://bucket/prefix (default: backup.target)."),
]


@contextlib.contextmanager
def _progress(enabled: bool, label: str) -> Iterator[Any]:
    """A rich progress bar fed by ``progress(phase, done, total)`` callbacks."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        tasks: dict[str, Any] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(f"{label}: {phase}", total=total or 1)
            bar.update(tasks[phase], completed=done, total=total or 1)

        yield update


@backup_app.command("create")
def backup_create(
    target: TargetOpt = None,
    retention_class: Annotated[
        str | None, typer.Option("--class", help="Retention class (default: backup.default_class).")
    ] = None,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Take a backup generation: consistent, incremental, signed; partitions are
    copied as the ciphertext they are, the key store sealed under the current epoch."""
    with Keyshred.open(path) as ks, _progress(not as_json, "backup") as progress:
        gen = ks.backup.create(target, retention_class=retention_class, progress=progress)
    _emit(
        gen.as_dict(),
        as_json,
        f"generation {gen.generation}: {gen.segments} segments of {gen.subjects} subjects, "
        f"{gen.objects_uploaded} objects copied ({gen.bytes_uploaded} bytes), "
        f"{gen.objects_reused} unchanged; expires {gen.expires_at:%Y-%m-%d}",
    )


@backup_app.command("list")
def backup_list(
    target: TargetOpt = None, path: PathOpt = Path("."), as_json: JsonOpt = False
) -> None:
    """Every complete generation, oldest first (manifests verified)."""
    with Keyshred.open(path) as ks:
        gens = ks.backup.generations(target)
    if as_json:
        typer.echo(json.dumps({"generations": [g.as_dict() for g in gens]}, sort_keys=True))
        return
    table = Table(title="backup generations")
    for col in ("generation", "class", "created", "expires", "KEK epoch", "segments", "bytes"):
        table.add_column(col)
    for g in gens:
        table.add_row(
            g.generation,
            g.retention_class,
            f"{g.created_at:%Y-%m-%d %H:%M}",
            f"{g.expires_at:%Y-%m-%d}",
            # Which lineage: an archive epoch is the generation's own, a live one
            # (generations made before the archive lineage) is shared with the store.
            f"{g.kek_lineage} {g.kek_epoch}",
            str(g.segments),
            str(g.bytes_total),
        )
    out.print(table)


@backup_app.command("restore")
def backup_restore(
    generation: Annotated[str, typer.Argument(help="The generation id (see 'backup list').")],
    into: Annotated[Path, typer.Option("--into", help="A new, empty folder.")],
    target: TargetOpt = None,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Restore into an isolated folder, replay every later tombstone, verify, expose."""
    with Keyshred.open(path) as ks, _progress(not as_json, "restore") as progress:
        report = ks.backup.restore(generation, into, target=target, progress=progress)
    _emit(
        report.as_dict(),
        as_json,
        f"restored {generation} into {into}: {len(report.replayed)} tombstones replayed, "
        f"{report.subjects_verified} subjects and {report.memories_verified} memories verified",
    )


@backup_app.command("prune")
def backup_prune(
    target: TargetOpt = None, path: PathOpt = Path("."), as_json: JsonOpt = False
) -> None:
    """Delete expired generations (every object version) and unneeded objects."""
    with Keyshred.open(path) as ks:
        pruned = ks.backup.prune(target)
    _emit({"pruned": pruned}, as_json, f"pruned {len(pruned)} generations")


def _maintain(target: str | None, path: Path, as_json: bool) -> None:
    with Keyshred.open(path) as ks:
        report = ks.backup.maintain(target)
    _emit(
        report.as_dict(),
        as_json,
        f"live epoch {report.live_epoch} (rotated to {report.rotated_to}; next due "
        f"{report.live_due_at.isoformat() if report.live_due_at else '?'}); destroyed live "
        f"epochs {[d.epoch for d in report.destroyed]}, archive epochs "
        f"{[d.epoch for d in report.archive_destroyed]}; pruned {len(report.pruned)} generations",
    )


@app.command("maintain")
def maintain(target: TargetOpt = None, path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """The scheduled job: rotate the live KEK epoch when due and destroy the previous
    one once nothing is wrapped by it, destroy the archive epochs of expired backup
    generations, prune. Schedule it every keyring.maintain_every_minutes (default 5):
    a live epoch is rotated at the first run within that interval of its end, so it
    is destroyed by the receipts' live_residue_until as long as the job keeps to it."""
    _maintain(target, path, as_json)


@backup_app.command("maintain")
def backup_maintain(
    target: TargetOpt = None, path: PathOpt = Path("."), as_json: JsonOpt = False
) -> None:
    """Same as 'keyshred maintain' (kept for existing schedules)."""
    _maintain(target, path, as_json)


@verify_app.command("residue")
def verify_residue(
    paths: Annotated[
        # Text, not Path: a Path folds the "//" of s3://bucket/prefix.
        list[str],
        typer.Argument(
            metavar="PATH",
            help="Folders or files to scan: a data folder (with its S3 prefixes and S3 "
            "backup targets), backups, exports; or s3://bucket/prefix (through [s3]).",
        ),
    ],
    probe: Annotated[
        list[str] | None,
        typer.Option("--probe", help="Text to look for (repeat the option for several)."),
    ] = None,
    probes_file: Annotated[
        Path | None,
        typer.Option(
            "--probes-file", help="A file with one probe a line (keeps them out of argv)."
        ),
    ] = None,
    path: Annotated[
        Path,
        typer.Option(
            "--path",
            "-p",
            "--data",
            envvar="KEYSHRED_PATH",
            help="The data folder whose live keyring decrypts (default: .).",
        ),
    ] = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Search files and S3 objects (every version) for probes, raw (UTF-8, UTF-16,
    hex, base64, JSON-escaped) and decrypted with every key the live keyring still
    unwraps. Prints probe numbers, never probes. Exits 0 when nothing is found, 1
    when something is."""
    probes = list(probe or [])
    if probes_file is not None:
        try:
            lines = probes_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            raise KeyshredError(f"cannot read {probes_file} as UTF-8 text") from None
        probes += [line for line in lines if line.strip()]
    if not probes:
        raise KeyshredError("give at least one --probe (or --probes-file)")
    with Keyshred.open(path) as ks:
        report = ks.erasure.residue_scan(probes, paths)
    if as_json:
        typer.echo(json.dumps(report.as_dict(), sort_keys=True))
    else:

        def counts(which: dict[str, int]) -> str:
            return ", ".join(f"{n} {k}" for k, n in sorted(which.items())) or "none"

        out.print(
            f"residue scan: {report.files_scanned} files, {report.objects_scanned} S3 object "
            f"versions, {report.bytes_scanned} bytes, "
            f"{report.probes} probe(s) in {report.seconds:.2f} s",
            highlight=False,
        )
        for store in report.object_stores:
            listed = (
                f"{store['objects']} current, {store['noncurrent']} noncurrent, "
                f"{store['delete_markers']} delete markers"
                if store.get("listed")
                else "could not be listed"
            )
            out.print(f"S3 {store['role']} {store['url']}: {listed}", highlight=False, markup=False)
        out.print(f"decrypted with live keys: {counts(report.decrypted)}", highlight=False)
        out.print(f"undecryptable (erased): {counts(report.undecryptable)}", highlight=False)
        if report.unreadable:
            out.print(f"unreadable: {counts(report.unreadable)}", highlight=False)
        if report.locked:
            out.print(f"sealed to a recipient: {counts(report.locked)}", highlight=False)
        for h in report.hits:
            version = f" (version {h.version})" if h.version else ""
            typer.echo(
                f"HIT probe #{h.probe} {h.layer} {h.encoding} in {h.kind} "
                f"{report.roots[h.root]}: {h.path}{version}"
            )
        out.print(
            "[green]no probe found[/green]"
            if report.clean
            else f"[red]{len(report.hits)} hit(s)[/red]"
        )
    if not report.clean:
        raise typer.Exit(1)


@app.command()
def repair(
    subject_ref: Annotated[
        str | None, typer.Argument(help="The subject_ref an error named (default: all).")
    ] = None,
    apply: Annotated[bool, typer.Option("--apply", help="Reconcile (default: report).")] = False,
    forget_lost: Annotated[
        bool,
        typer.Option(
            "--forget-lost",
            help="With --apply, also drop catalog entries of memories gone without a "
            "recorded deletion (a truncated file; the tamper alarm).",
        ),
    ] = False,
    path: PathOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Check memory partitions against the catalog; --apply reconciles what is safe.
    Exits 1 if something is found (dry run) or left unreconciled (--apply)."""
    with Keyshred.open(path) as ks:
        if subject_ref is None:
            reports = ks.memories.repair_all(apply=apply, forget_lost=forget_lost)
        else:
            reports = [ks.memories.repair(subject_ref, apply=apply, forget_lost=forget_lost)]
    ok = all(r.ok for r in reports)
    if as_json:
        data = {"ok": ok, "applied": apply, "partitions": [r.as_dict() for r in reports]}
        typer.echo(json.dumps(data, sort_keys=True))
    else:
        for r in reports:
            found = {k: len(v) for k, v in r.as_dict().items() if isinstance(v, list) and v}
            state = ("repaired" if r.ok else "still broken") if r.applied else "found"
            text = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in found.items())
            typer.echo(f"{r.subject_ref}: " + (f"{state}: {text}" if found else "clean"))
        if not ok and not apply:
            typer.echo("run again with --apply to reconcile (lost memories need --forget-lost)")
    if not ok:
        raise typer.Exit(1)


@app.command()
def migrate(path: PathOpt = Path("."), as_json: JsonOpt = False) -> None:
    """Finish an upgrade now: the catalog's schema is migrated on every open; this also
    imports every memory partition an earlier release kept as MANIFEST and log files
    (each is imported on its first use anyway). Subjects under erasure are left to it."""
    with Keyshred.open(path) as ks:
        done, left = ks.memories.import_legacy()
    if as_json:
        typer.echo(json.dumps({"imported": done, "left_to_erasure": left}, sort_keys=True))
        return
    typer.echo(f"{len(done)} partitions of the earlier layout imported")
    if left:
        typer.echo(f"{len(left)} left to their erasure in progress: " + ", ".join(left))


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
