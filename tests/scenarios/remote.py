"""Remote checkpoints on real vLLM, in its own process; prints a JSON result on the last line.

Usage: python tests/scenarios/remote.py WORKDIR
with TM_TEST_S3_ENDPOINT, TM_TEST_S3_KEY_ID, TM_TEST_S3_SECRET naming an S3-compatible server on
127.0.0.1 (the test starts moto's and stops it).

Steps, on the tiny Llama: reference tokens with vLLM's default loader on the safetensors; save with
a manifest straight to s3://checkpoints/remote/llama (credentials as save options); read the manifest
and validate the checkpoint from there (hashes included); fetch its config and tokenizer into a local
directory; load it with load_format="tensorizer_manifest" streaming from S3 (credentials in
model_loader_extra_config); copy the objects under a plain HTTP server (this process, 127.0.0.1, Range
support) and load from http://; then load from an HTTP server that drops the connection halfway through
the tensor file, which must fail with a typed error and start no engine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers


def main() -> None:
    workdir = Path(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    endpoint = os.environ["TM_TEST_S3_ENDPOINT"]
    key_id, secret = os.environ["TM_TEST_S3_KEY_ID"], os.environ["TM_TEST_S3_SECRET"]

    from helpers.servers import BUCKET, RangeHTTPServer

    from tensorizer_manifest.checks.validate import validate_checkpoint
    from tensorizer_manifest.cli.demo import generate_tokens
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model, engine_args
    from tensorizer_manifest.save.from_source import save_checkpoint
    from tensorizer_manifest.storage.checkpoint import load_manifest
    from tensorizer_manifest.storage.remote import RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import fetch_model_files

    kind = "llama"
    model_dir = build_tiny_model(workdir / f"tiny-{kind}", kind)
    uri = f"s3://{BUCKET}/remote/{kind}"
    options = RemoteOptions(key_id, secret, endpoint)
    result: dict = {"uri": uri}

    result["reference_tokens"], _, _ = generate_tokens(model_dir, "auto", **engine_args(kind))

    saved = save_checkpoint(
        model_dir,
        uri,
        dtype="bfloat16",
        max_model_len=128,
        engine_args=engine_args(kind),
        s3_access_key_id=key_id,
        s3_secret_access_key=secret,
        s3_endpoint=endpoint,
    )
    result["saved_to"] = str(saved.out_dir)

    import boto3

    s3 = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key_id, aws_secret_access_key=secret
    )
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"remote/{kind}/")["Contents"])
    result["objects"] = [k.rpartition("/")[2] for k in keys]

    manifest, manifest_path = load_manifest(uri, remote=options)
    result["inspect"] = {"manifest": str(manifest_path), "layers": len(manifest.modules)}
    report = validate_checkpoint(uri, remote=options)
    result["validate"] = report.to_dict()

    cache = fetch_model_files(uri, workdir / "remote-cache-s3", options)
    result["fetched_s3"] = sorted(p.name for p in cache.iterdir())
    extra = {"checkpoint_dir": uri, "s3_access_key_id": key_id, "s3_secret_access_key": secret, "s3_endpoint": endpoint}
    load_report: dict = {}
    result["s3_tokens"], _, _ = generate_tokens(
        cache, "tensorizer_manifest", report=load_report, model_loader_extra_config=extra, **engine_args(kind)
    )
    result["s3_bytes_read"] = load_report.get("bytes_read")

    # The same objects under a plain HTTP server.
    root = workdir / "http-root"
    target = root / kind
    target.mkdir(parents=True, exist_ok=True)
    for key in keys:  # at the same paths: a generation's files are under generations/<id>/
        local = target / key.removeprefix(f"remote/{kind}/")
        local.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(BUCKET, key, str(local))
    with RangeHTTPServer(root) as server:
        http_uri = f"{server.url}/{kind}"
        http_cache = fetch_model_files(http_uri, workdir / "remote-cache-http")
        result["fetched_http"] = sorted(p.name for p in http_cache.iterdir())
        result["http_validate_ok"] = validate_checkpoint(http_uri).ok
        result["http_tokens"], _, _ = generate_tokens(
            http_cache,
            "tensorizer_manifest",
            model_loader_extra_config={"checkpoint_dir": http_uri},
            **engine_args(kind),
        )

    # A server that stops halfway through the tensor file.
    ref = manifest.tensor_file
    cut = ref.prefix_size + (ref.size - ref.prefix_size) // 2
    with RangeHTTPServer(root, cut_after=cut) as server:
        try:
            generate_tokens(
                http_cache,
                "tensorizer_manifest",
                model_loader_extra_config={"checkpoint_dir": f"{server.url}/{kind}"},
                **engine_args(kind),
            )
            result["cut"] = {"engine_started": True}
        except Exception as exc:  # what vLLM lets through
            chain, cursor = [], exc
            while cursor is not None and len(chain) < 8:
                chain.append({"type": type(cursor).__name__, "mro": [c.__name__ for c in type(cursor).__mro__],
                              "message": str(cursor)[:500]})  # fmt: skip
                cursor = cursor.__cause__ or cursor.__context__
            result["cut"] = {"engine_started": False, "chain": chain, "cut_at": cut, "size": ref.size}

    result["secret_in_objects"] = any(
        secret.encode() in s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys
    )
    print("REMOTE_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
