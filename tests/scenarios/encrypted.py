"""Encryption on real vLLM, run in its own process; prints a JSON result on the last line.

Usage: python tests/scenarios/encrypted.py WORKDIR

A tiny Llama saved twice, encrypted and plain (the control); greedy tokens of
the encrypted one loaded with its key against vLLM's default loader; the load
refused with a wrong key and without one (the error's type and message); and
whether 64 bytes of one embedding row appear in each tensor file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    workdir = sys.argv[1]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from safetensors.torch import load_file

    from tensorizer_manifest.cli.demo import generate_tokens
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model, engine_args
    from tensorizer_manifest.save.from_source import save_checkpoint
    from tensorizer_manifest.storage.checkpoint import load_manifest

    model_dir = build_tiny_model(os.path.join(workdir, "tiny-llama"), "llama")
    key, wrong = os.path.join(workdir, "encryption.key"), os.path.join(workdir, "wrong.key")
    with open(key, "wb") as f:
        f.write(os.urandom(32))
    with open(wrong, "wb") as f:
        f.write(os.urandom(32))
    result: dict = {}
    engine = engine_args("llama")
    result["reference_tokens"], _, _ = generate_tokens(model_dir, "auto", **engine)

    secret, plain = os.path.join(workdir, "ckpt-llama-encrypted"), os.path.join(workdir, "ckpt-llama-plain")
    save_checkpoint(model_dir, secret, dtype="bfloat16", max_model_len=128, engine_args=engine, encryption_key_file=key)
    save_checkpoint(model_dir, plain, dtype="bfloat16", max_model_len=128, engine_args=engine)
    manifest, manifest_path = load_manifest(secret)
    result["encryption"] = manifest.tensor_file.encryption
    result["seal"] = manifest.seal.mode

    state = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(model_dir, name)))
    row = state["model.embed_tokens.weight"][5].contiguous()
    run = row.view(-1).view(__import__("torch").uint8).numpy().tobytes()[:64]
    for label, directory in (
        ("encrypted", secret),
        ("plain", plain),
    ):  # every tensor file: the form set's and the base's
        tensor_files = sorted(Path(directory, "generations").rglob("*.tensors"))
        result[f"{label}_tensor_files"] = [p.name.partition(".")[0] for p in tensor_files]
        result[f"embedding_bytes_in_{label}_file"] = any(run in p.read_bytes() for p in tensor_files)

    report: dict = {}
    result["manifest_tokens"], _, _ = generate_tokens(
        secret, "tensorizer_manifest", report=report, loader_config={"encryption_key_file": key}, **engine
    )
    result["report_encrypted"] = report.get("encrypted")
    for label, config in (("wrong_key", {"encryption_key_file": wrong}), ("no_key", {})):
        try:
            generate_tokens(secret, "tensorizer_manifest", loader_config=config, **engine)
            result[label] = None
        except Exception as exc:  # vLLM may wrap it: keep the whole chain's names and messages
            chain, seen = [], exc
            while seen is not None:
                chain.append(f"{type(seen).__name__}: {seen}")
                seen = seen.__cause__ or seen.__context__
            result[label] = chain
    with open(key, "rb") as f:
        secret_hex = f.read().hex()
    result["key_in_manifest"] = secret_hex in manifest_path.read_text()
    print("ENCRYPTED_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
