"""The files vLLM reads by name stay one generation's: a re-save whose source lacks a file an older save had (a
chat template, a SentencePiece model) leaves none of it at the top, a fetch none of an earlier fetch's, a model
directory holding one is refused at load by name, and a killed writer's temporaries at the top are cleaned."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from helpers.synthetic import save_generation

from tensorizer_manifest.checks.generation_files import check_generation
from tensorizer_manifest.errors import IntegrityError
from tensorizer_manifest.storage.files import temporary_name, this_host


def _source(tmp_path, name, extras=()):
    source = tmp_path / name
    source.mkdir()
    (source / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (source / "tokenizer.json").write_text(f'{{"version": "{name}"}}\n')
    for extra in extras:
        (source / extra).write_text(f"{name}'s {extra}\n")
    return source


def test_a_re_save_without_an_older_save_s_chat_template_leaves_none_at_the_top(tmp_path):
    root = tmp_path / "ckpt"
    save_generation(root, _source(tmp_path, "a", extras=("chat_template.jinja", "tokenizer.model")), seed=0)
    assert (root / "chat_template.jinja").is_file() and (root / "tokenizer.model").is_file()
    second = save_generation(root, _source(tmp_path, "b"), seed=1)
    assert not (root / "chat_template.jinja").exists() and not (root / "tokenizer.model").exists()
    assert (root / "tokenizer.json").read_text() == '{"version": "b"}\n'
    check_generation(second, False, None, None, root)  # the top is B's, whole


def test_a_model_directory_holding_a_file_the_generation_has_not_is_refused_by_name(tmp_path):
    root = tmp_path / "ckpt"
    generation = save_generation(root, _source(tmp_path, "a"), seed=0)
    (root / "chat_template.jinja").write_text("another save's template\n")
    with pytest.raises(IntegrityError, match=r"chat_template\.jinja: the checkpoint's generation .* has no"):
        check_generation(generation, False, None, None, root)
    (root / "README.md").write_text("not read by vLLM\n")  # a file vLLM does not read by name is no matter
    (root / "chat_template.jinja").unlink()
    check_generation(generation, False, None, None, root)


def test_fetch_leaves_none_of_an_earlier_fetch_s_files(moto_s3, tmp_path):
    from helpers.remote import fresh_prefix, options_for

    from tensorizer_manifest.storage.remote_checkpoint import fetch_model_files, publish_to_s3

    uri, options = fresh_prefix("top"), options_for(moto_s3)
    first = tmp_path / "staging-a"
    save_generation(first, _source(tmp_path, "a", extras=("chat_template.jinja",)), seed=0)
    publish_to_s3(first, uri, options)
    cache = tmp_path / "fetched"
    fetch_model_files(uri, cache, options)
    assert (cache / "chat_template.jinja").is_file()
    second = tmp_path / "staging-b"
    save_generation(second, _source(tmp_path, "b"), seed=1)
    publish_to_s3(second, uri, options)
    fetch_model_files(uri, cache, options)
    assert not (cache / "chat_template.jinja").exists()
    assert (cache / "tokenizer.json").read_text() == '{"version": "b"}\n'
    from tensorizer_manifest.storage.remote import RemoteDir

    assert "chat_template.jinja" not in RemoteDir(uri, options).list_names()  # nor at the prefix's top


def test_a_killed_writer_s_temporaries_at_the_top_are_cleaned_and_a_live_one_s_kept(tmp_path):
    root = tmp_path / "ckpt"
    save_generation(root, _source(tmp_path, "a"), seed=0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = root / f".config.json.{this_host()}.{dead.stdout.strip()}-1.tmp"
    killed.write_text("half")
    alive = root / f".config.json.{this_host()}.{os.getppid()}-1.tmp"
    alive.write_text("still writing")
    other_host = root / f".config.json.elsewhere.{dead.stdout.strip()}-1.tmp"
    other_host.write_text("another host's")
    save_generation(root, _source(tmp_path, "b"), seed=1)
    assert not killed.exists() and alive.exists() and other_host.exists()


def test_two_threads_of_one_process_never_share_a_temporary():
    names, together = set(), threading.Barrier(4)

    def name_one() -> None:
        together.wait(10)  # all four alive at once: thread ids are reused only after a thread ends
        names.add(temporary_name("config.json"))
        together.wait(10)

    threads = [threading.Thread(target=name_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(names) == 4
