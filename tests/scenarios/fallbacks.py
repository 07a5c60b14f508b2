"""Load one checkpoint as three machines would, and once damaged, counting what is read and which steps run.

Usage: python tests/scenarios/fallbacks.py CHECKPOINT WORKDIR KIND [--as-saved-only]

- ``as-saved``: the checkpoint as saved here: every layer's processed form fits.
- ``other-form``: its first layer with a fallback records the other x86 machine's form (the ISA flipped, as
  an AMX machine saves what an AVX-512 one would not produce, and the other way round), re-sealed: that
  layer alone must load through its fallback, the rest processed.
- ``older-vllm``: the fingerprint says vLLM 0.31.0 saved it (re-sealed): every layer whose processed form
  is kernel-specific must load through its fallback (the policy of ``fingerprint.PROCESSED_ONLY``).
- ``other-form-damaged``: as ``other-form``, with one byte of that layer's fallback flipped: refused.
- ``added-form``: every layer with a fallback records the other machine's form, then ``add_form`` adds this
  machine's (an engine of its own, before the counted loads): those layers must load that form, processed.
  ``add-form-float16`` is the same ``add_form`` with another dtype than the saved one: refused.
- ``added-form-unused``: the added-form checkpoint with the saved forms fitting here again and the added
  form's file deleted: loads processed, the form never opened. ``added-form-missing``, ``-truncated``,
  ``-unknown-replay`` (a restorer of a newer version), ``-newer-field`` (a field of a newer version, sealed
  as that version would) and ``-other-base`` (made from other raw fallbacks than the manifest's, as a form
  added before a re-save): the form is skipped, said in vLLM's log and the report, and those layers load
  through their fallbacks.
- ``s3-added-form`` (with ``TM_TEST_S3_ENDPOINT``, ``_KEY_ID``, ``_SECRET``): the other machine's checkpoint
  on S3, ``add_form`` on its URI, loaded from there.

Each case runs on real vLLM in this process with vLLM's post-load steps counted per layer and every tensor
the reader hands out counted; prints ``FALLBACKS_RESULT {json}`` (vLLM's log, on stdout, names each
checkpoint's manifest in its lines).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

#: A restorer no version of this package has: what a form added by a newer tensorizer-manifest may name.
NEWER_RESTORER = "restorer_from_a_newer_version"


def _a_newer_versions_restorer(manifest) -> None:
    for module in manifest.added_forms[0].modules:
        module.replay = NEWER_RESTORER


def _a_newer_versions_field(manifest) -> bytes:
    """The manifest with a field this version does not know in its first added form, sealed again as the newer
    version that wrote the field would seal it."""
    import msgspec

    from tensorizer_manifest.format import schema

    document = msgspec.json.decode(schema.encode_manifest(manifest))
    document["added_forms"][0]["made_by"] = {"a_field_of_a_newer_version": True}
    newer = schema.decode_manifest(msgspec.json.encode(document))
    assert isinstance(newer.added_forms[0], schema.UnreadableForm), newer.added_forms[0]
    newer.seal = schema.seal_manifest(newer)
    return schema.encode_manifest(newer)


def _made_from_other_fallbacks(manifest) -> None:
    manifest.added_forms[0].base = "blake3:" + "0" * 64


def _edit_form_file(checkpoint: Path, how: str) -> None:
    """Delete the first added form's tensor file, or truncate it by one byte (a file of its own: it is a link)."""
    from tensorizer_manifest.storage.checkpoint import load_manifest, resolve_tensor_file

    manifest, manifest_path = load_manifest(checkpoint)
    path = resolve_tensor_file(manifest, manifest_path, manifest.added_forms[0].tensor_file)
    data = path.read_bytes()
    path.unlink()
    if how == "truncate":
        path.write_bytes(data[:-1])


def _every_file(checkpoint: Path) -> list[str]:
    """Every file under the checkpoint, by its path there and its bytes' hash."""
    from tensorizer_manifest.format.schema import blake3_hex

    return sorted(
        f"{p.relative_to(checkpoint)} {blake3_hex(p.read_bytes())}" for p in checkpoint.rglob("*") if p.is_file()
    )


def main() -> None:
    checkpoint, workdir, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    as_saved_only = "--as-saved-only" in sys.argv  # a checkpoint another engine saved: loaded as it is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from helpers.errors import error_summary
    from helpers.other_machine import as_the_other_machine, edited_copy
    from helpers.post_load import install_post_load_counter

    from tensorizer_manifest.cli.demo import generate_tokens
    from tensorizer_manifest.embedded_models.tiny import engine_args
    from tensorizer_manifest.storage import tensor_file

    if not as_saved_only:
        # Raw fallbacks stored in the form set: a save without a base. (With one, the default, a fallback is the
        # base's, fed from it when taken: test_e2e_base_quantized.py.) The model is the one the e2e save used.
        from tensorizer_manifest.save.from_source import save_checkpoint

        no_base = workdir / f"ckpt-{kind}-no-base"
        if not (no_base / "tensorizer-manifest.json").exists():
            save_checkpoint(workdir / f"tiny-{kind}", no_base, dtype="bfloat16", base="none",
                            engine_args=engine_args(kind))  # fmt: skip
        with_base, checkpoint = checkpoint, no_base
    counts = install_post_load_counter()
    read: dict[str, list] = {"keys": []}
    stream = tensor_file.TensorFileReader.stream

    def counting_stream(self, *args, **kwargs):
        for key, tensor in stream(self, *args, **kwargs):
            read["keys"].append([self.path.name, key, tensor.numel() * tensor.element_size()])
            yield key, tensor

    tensor_file.TensorFileReader.stream = counting_stream

    def other_form(manifest):
        as_the_other_machine(manifest, layers=1)

    def older_vllm(manifest):
        manifest.fingerprint.vllm_version = "0.31.0"

    cases = {"as-saved": checkpoint}
    if not as_saved_only:
        cases["other-form"] = edited_copy(checkpoint, workdir / f"{kind}-other-form", other_form)
        cases["older-vllm"] = edited_copy(checkpoint, workdir / f"{kind}-older-vllm", older_vllm)
        cases["other-form-damaged"] = edited_copy(checkpoint, workdir / f"{kind}-damaged", other_form, damage=True)
    result: dict = {}
    if not as_saved_only:
        # Saved with a base (the default): the fallbacks are the base's, a layer that takes one is fed from it,
        # and add-form makes this machine's form from what the base fed.
        from tensorizer_manifest.save.add_form import add_form

        cases["base-other-form"] = edited_copy(with_base, workdir / f"{kind}-base-other-form", other_form)
        cases["base-other-form-damaged"] = edited_copy(
            with_base, workdir / f"{kind}-base-damaged", other_form, damage=True
        )
        base_added = edited_copy(with_base, workdir / f"{kind}-base-added-form", as_the_other_machine)
        result["base-add-form"] = add_form(base_added).ranks[0]
        cases["base-added-form"] = base_added
        # The other machine's checkpoint (every layer with a fallback records the other form), and this machine
        # adds its own form to it: add_form starts an engine here, before the counted loads.
        from tensorizer_manifest.save.add_form import add_form

        added = edited_copy(checkpoint, workdir / f"{kind}-added-form", as_the_other_machine)
        # As a person types it, on a terminal (the installed script, its engine in its own process as set above);
        # what it added is read back from the checkpoint it committed.
        from helpers.terminal import typed

        from tensorizer_manifest import read_manifest

        shown = typed("add-form", str(added), timeout=900)
        form = read_manifest(added).added_forms[-1] if shown.returncode == 0 else None
        result["add-form"] = {
            "returncode": shown.returncode,
            "said": shown.flat,
            "added": [] if form is None else [module.path for module in form.modules],
            "tensor_file": None if form is None else form.tensor_file.path,
        }
        cases["added-form"] = added
        # A form is an optimisation, never a single point of failure: one this loader cannot use is skipped.
        cases["added-form-unused"] = edited_copy(added, workdir / f"{kind}-added-form-unused", as_the_other_machine)
        _edit_form_file(cases["added-form-unused"], "delete")  # the saved form fits again: the form is never opened
        cases["added-form-missing"] = edited_copy(added, workdir / f"{kind}-added-form-missing", lambda m: None)
        _edit_form_file(cases["added-form-missing"], "delete")
        cases["added-form-truncated"] = edited_copy(added, workdir / f"{kind}-added-form-truncated", lambda m: None)
        _edit_form_file(cases["added-form-truncated"], "truncate")
        cases["added-form-unknown-replay"] = edited_copy(
            added, workdir / f"{kind}-added-form-unknown-replay", _a_newer_versions_restorer
        )
        cases["added-form-newer-field"] = edited_copy(
            added, workdir / f"{kind}-added-form-newer-field", _a_newer_versions_field
        )
        cases["added-form-other-base"] = edited_copy(
            added, workdir / f"{kind}-added-form-other-base", _made_from_other_fallbacks
        )
        refused = edited_copy(checkpoint, workdir / f"{kind}-add-form-float16", as_the_other_machine)
        before = _every_file(refused)
        try:
            add_form(refused, engine_args={"dtype": "float16"})
            result["add-form-float16"] = {"error": None}
        except Exception as exc:  # noqa: BLE001
            found = error_summary(exc)
            result["add-form-float16"] = {"error": f"{found['error']}: {found['message']}"}
        result["add-form-float16"]["files"] = _every_file(refused)
        result["add-form-float16"]["files_before"] = before
    s3 = None
    if not as_saved_only and os.environ.get("TM_TEST_S3_ENDPOINT"):
        # The same on S3: the other machine's checkpoint uploaded, add_form on its URI, then loaded from there.
        from helpers.servers import BUCKET

        from tensorizer_manifest.storage.generations import S3Checkpoint
        from tensorizer_manifest.storage.remote import RemoteDir, RemoteOptions
        from tensorizer_manifest.storage.remote_checkpoint import fetch_model_files, publish_to_s3

        endpoint, key_id, secret = (os.environ[f"TM_TEST_S3_{k}"] for k in ("ENDPOINT", "KEY_ID", "SECRET"))
        creds = {"s3_access_key_id": key_id, "s3_secret_access_key": secret, "s3_endpoint": endpoint}
        uri = f"s3://{BUCKET}/fallbacks/{kind}-{os.getpid()}"
        options = RemoteOptions(key_id, secret, endpoint)
        publish_to_s3(edited_copy(checkpoint, workdir / f"{kind}-s3", as_the_other_machine), uri, options)
        result["s3-add-form"] = add_form(uri, **creds).ranks[0]
        current = S3Checkpoint(RemoteDir(uri, options)).current()
        result["s3-add-form"]["current"] = {
            "id": current.id,
            "made_by": current.made_by,
            "tensor_files": [path for form_set in current.form_sets for r in form_set.ranks for path in r.tensor_files],
        }
        s3 = (fetch_model_files(uri, workdir / f"{kind}-s3-cache", RemoteOptions(key_id, secret, endpoint)),
              {"checkpoint_dir": uri, **creds})  # fmt: skip
        cases["s3-added-form"] = s3[0]
    for name, path in cases.items():
        counts.clear()
        read["keys"] = []
        report: dict = {}
        entry: dict = {"error": None}
        loader = s3[1] if s3 is not None and path == s3[0] else None
        try:
            entry["tokens"] = generate_tokens(
                path, "tensorizer_manifest", report=report, loader_config=loader, **engine_args(kind)
            )[0]
        except Exception as exc:  # noqa: BLE001
            found = error_summary(exc)
            entry["error"] = f"{found['error']}: {found['message']}"
        from tensorizer_manifest.storage.checkpoint import load_manifest

        if loader is not None:
            manifest = load_manifest(loader["checkpoint_dir"], remote=RemoteOptions(key_id, secret, endpoint))[0]
        else:
            manifest = load_manifest(path)[0]
        entry["forms"] = report.get("forms")
        entry["post_load_counts"] = {f"{label}:{layer}": n for (label, layer), n in counts.items()}
        entry["keys_read"] = read["keys"]
        entry["bytes_read"] = report.get("bytes_read")
        entry["layers_fed"] = report.get("layers_fed", [])
        entry["layers"] = {
            m.path: {
                "state": m.state,
                "replay": m.replay,
                "keys": [t.key for t in m.tensors if t.key is not None and t.alias_of is None],
                "fallback_keys": [t.key for t in m.fallback],
                "fallback_bytes": sum(t.nbytes for t in m.fallback),
                "hashes": {t.name: t.hash for t in m.tensors},
            }
            for m in manifest.modules
        }
        entry["tensor_file"] = manifest.tensor_file.path
        entry["added_forms"] = [
            {"tensor_file": f.tensor_file.path, "cpu_features": f.fingerprint.cpu_features,
             "layers": {m.path: {"keys": [t.key for t in m.tensors if t.key and not t.alias_of], "form": m.form,
                                 "hashes": {t.name: t.hash for t in m.tensors}} for m in f.modules}}
            for _, f in manifest.readable_forms()
        ]  # fmt: skip
        result[name] = entry
    result["checkpoint"] = str(checkpoint)
    print("FALLBACKS_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
