"""``gc``: remove the files of a checkpoint of format version 3 that no generation current within its grace
period names (``storage.generations`` plans and removes; writers run it after each commit)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import ConfigurationError, TensorizerManifestError
from .output import console, fail, json_dumps
from .parameters import json_option, location_of, remote_from, remote_options


@click.command()
@click.argument("checkpoint")
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Seconds a generation stays after a newer one is committed (loaders that read the older pointer finish).",
)
@click.option(
    "--orphan-grace",
    type=click.FloatRange(min=0),
    default=86400.0,
    show_default=True,
    help="Seconds files no committed generation names (a writer killed, or still writing) stay after their last "
    "write; longer than your slowest save.",
)
@click.option(
    "--keep",
    "keep",
    multiple=True,
    metavar="GENERATION_ID",
    help="Keep this generation and every file it names, whatever its age (one vLLM serves as "
    "CHECKPOINT/generations/<id>). Repeatable.",
)
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@json_option
@remote_options
def gc(checkpoint: str, grace: float, orphan_grace: float, keep: tuple[str, ...], dry_run: bool, json: bool,
       **remote) -> None:  # fmt: skip
    """Remove the files of CHECKPOINT (format version 3; a directory or an s3:// URI) that no generation current
    within the grace period names, and orphans past theirs. Ages are read off the storage's own clock.

    Writers do this after each commit with the defaults; run it to reclaim space sooner or on a schedule."""
    from ..format.generation import is_generation_id
    from ..storage.backends import backend_for
    from ..storage.generations import CheckpointStore
    from ..storage.remote import RemoteDir

    try:
        for generation_id in keep:
            if not is_generation_id(generation_id):
                raise ConfigurationError(
                    f"--keep {generation_id}: not a generation id (a folder name under generations/, as "
                    "'tensorizer-manifest inspect' lists them)"
                )
        location = location_of(checkpoint)
        if isinstance(location, str) and not location.startswith("s3://"):
            raise ConfigurationError(f"{location}: gc removes files; an http(s) checkpoint is read-only")
        root = location if isinstance(location, Path) else RemoteDir(location, remote_from(**remote))
        store = CheckpointStore(backend_for(root))
        plan = store.plan_gc(grace_s=grace, orphan_grace_s=orphan_grace, keep=keep)
        removed = [] if dry_run else store.gc(plan)
    except TensorizerManifestError as exc:
        fail(exc)
    if json:
        report = {"current": plan.current, "kept_generations": plan.kept_generations, "delete": plan.delete,
                  "removed": removed, "waiting": plan.waiting}  # fmt: skip
        console().print_json(json_dumps(report))
        return
    console().print(f"current generation {plan.current}; kept: {', '.join(plan.kept_generations)}", highlight=False)
    for path in plan.delete if dry_run else removed:
        console().print(f"{'would remove' if dry_run else 'removed'} {path}", highlight=False)
    for path, why in plan.waiting.items():
        console().print(f"kept for now: {path} ({why})", highlight=False)
