"""The model folder's small files are untrusted input (issue 45): a link out of the folder
is refused naming the file, a device or FIFO is "not a regular file" (not "missing") and
never blocks, and every file has a size cap."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from daemon_helpers import GLM_TEMPLATE, install_chat_tokenizer

from colibrid.engine import model_files
from colibrid.engine.tokenizer import TextCodec, has_tokenizer, load_stop_token_ids
from colibrid.errors import CheckpointError


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    """A folder with a tokenizer and a template, built once (copied per test)."""
    root = tmp_path_factory.mktemp("tok") / "model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"vocab_size": 384, "eos_token_id": 0}))
    install_chat_tokenizer(root)
    return root


@pytest.fixture
def model(tokenizer_folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tokenizer_folder, copy)
    return copy


def test_a_plain_folder_loads(model: Path) -> None:
    codec = TextCodec.load(model)
    assert codec.has_chat_template and has_tokenizer(model)


def test_a_template_linked_out_of_the_folder_is_refused(model: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's private key")
    (model / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(
        CheckpointError,
        match=r"chat_template\.jinja \(a link to .*secret.txt\) is outside the model folder",
    ):
        TextCodec.load(model)


def test_links_inside_the_folder_are_fine(model: Path) -> None:
    (model / "templates").mkdir()
    (model / "templates" / "chat.jinja").write_text(GLM_TEMPLATE)
    (model / "chat_template.jinja").symlink_to(Path("templates") / "chat.jinja")
    assert TextCodec.load(model).has_chat_template


def test_the_hugging_face_cache_layout_is_inside(model: Path, tmp_path: Path) -> None:
    """snapshots/REV/tokenizer.json -> ../../blobs/HASH: the repository's own blobs."""
    repo = tmp_path / "hub" / "models--x--y"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for entry in model.iterdir():
        shutil.copy(entry, blobs / ("h" + entry.name))
        (snapshot / entry.name).symlink_to(Path("../../blobs") / ("h" + entry.name))
    assert TextCodec.load(snapshot).has_chat_template


@pytest.mark.parametrize("kind", ["urandom", "fifo", "directory"])
def test_a_tokenizer_that_is_not_a_regular_file_says_so(model: Path, kind: str) -> None:
    tok = model / "tokenizer.json"
    tok.unlink()
    if kind == "urandom":
        tok.symlink_to("/dev/urandom")
        want = r"a link to /dev/urandom\) is not a regular file \(a character device\)"
    elif kind == "fifo":
        os.mkfifo(tok)
        want = r"not a regular file \(a FIFO\)"
    else:
        tok.mkdir()
        want = r"not a regular file \(a directory\)"
    assert has_tokenizer(model)  # the daemon loads it (and refuses it), not "no tokenizer"
    with pytest.raises(CheckpointError, match=r"tokenizer\.json") as err:
        TextCodec.load(model)
    assert "has no tokenizer.json" not in str(err.value)
    assert err.match(want)


def test_a_device_inside_the_folder_is_not_a_regular_file(model: Path) -> None:
    """A FIFO named tokenizer_config.json: refused at once (opening it would block)."""
    (model / "tokenizer_config.json").unlink()
    os.mkfifo(model / "tokenizer_config.json")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json is not a regular file"):
        TextCodec.load(model)


def test_a_dangling_link_is_named_as_such(model: Path) -> None:
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to("gone.json")
    with pytest.raises(CheckpointError, match=r"a link to .*gone.json\) does not exist"):
        TextCodec.load(model)


def test_generation_config_linked_to_dev_zero_never_hangs(model: Path) -> None:
    (model / "generation_config.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"generation_config\.json"):
        load_stop_token_ids(model)


def test_files_have_a_size_cap(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (model / "chat_template.jinja").write_text(GLM_TEMPLATE + " " * 2000)
    monkeypatch.setattr(model_files, "MAX_TEMPLATE_BYTES", 1000)
    monkeypatch.setattr("colibrid.engine.tokenizer.MAX_TEMPLATE_BYTES", 1000)
    with pytest.raises(
        CheckpointError, match=r"chat_template\.jinja is \d+ bytes, over the 1000 byte cap"
    ):
        TextCodec.load(model)
