"""POST /slots/{id}?action=save|restore|erase over HTTP: round trip, safety, clear errors."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.http.harness import running_server

# packed weights with exact f32 activations: the native path, cached == uncached to the bit
NATIVE_F32 = ["--dtype", "f32", "--weights", "native"]

P = list(range(5000, 5080))


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("slots")
    save_dir = d / "saved"
    save_dir.mkdir()
    args = ["-m", tiny_path, *NATIVE_F32, "-np", "2", "-c", "8192", "--cache-ram", "0",
            "--slot-save-path", str(save_dir)]
    with running_server(args, str(d / "server.log")) as srv:
        srv.save_dir = save_dir
        yield srv


def complete(srv, prompt, **kw) -> dict:
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, **kw}
    r = httpx.post(srv.url + "/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def action(srv, slot, act, filename=None) -> httpx.Response:
    body = {} if filename is None else {"filename": filename}
    return httpx.post(f"{srv.url}/slots/{slot}?action={act}", json=body, timeout=60)


def test_save_erase_restore_continue(server):
    first = complete(server, P, id_slot=0)
    held = len(P) + len(first["tokens"]) - 1
    r = action(server, 0, "save", "conv.bin")
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["id_slot"] == 0 and saved["filename"] == "conv.bin"
    assert saved["n_saved"] == held and saved["n_written"] == os.path.getsize(
        server.save_dir / "conv.bin") and "save_ms" in saved["timings"]
    erased = action(server, 0, "erase").json()
    assert erased == {"id_slot": 0, "n_erased": held}
    restored = action(server, 0, "restore", "conv.bin").json()
    assert restored["n_restored"] == held and restored["n_read"] > 0
    follow = P + first["tokens"] + [777, 778]
    cont = complete(server, follow, id_slot=0)
    assert cont["timings"]["cache_n"] == held
    assert cont["tokens"] == complete(server, follow, id_slot=1, cache_prompt=False)["tokens"]


def test_restore_keeps_the_cache_salt(server):
    """A slot saved under one `cache_salt` is, once restored, reused by that salt alone."""
    prompt = list(range(5200, 5260))  # no prefix shared with the other tests' slots
    first = complete(server, prompt, id_slot=0, cache_salt="tenant-a")
    held = len(prompt) + len(first["tokens"]) - 1
    r = action(server, 0, "save", "salted.bin")
    assert r.status_code == 200 and r.json()["n_saved"] == held, r.text
    assert os.stat(server.save_dir / "salted.bin").st_mode & 0o777 == 0o600
    assert action(server, 0, "erase").status_code == 200
    follow = prompt + first["tokens"] + [777, 778]
    # uncached, and under a salt of its own: what slot 1 keeps must not serve the runs below
    fresh = complete(server, follow, id_slot=1, cache_prompt=False, cache_salt="fresh")
    assert fresh["timings"]["cache_n"] == 0
    for salt, want_cached in ((None, 0), ("tenant-b", 0), ("tenant-a", held)):
        r = action(server, 0, "restore", "salted.bin")
        assert r.status_code == 200 and r.json()["n_restored"] == held, r.text
        extra = {} if salt is None else {"cache_salt": salt}
        cont = complete(server, follow, id_slot=0, **extra)
        assert cont["timings"]["cache_n"] == want_cached, salt
        assert cont["tokens"] == fresh["tokens"], salt


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", ".hidden", "x" * 256, "a\x00b",
                                  "..", "link"])
def test_bad_filenames_are_rejected(server, name):
    outside = server.save_dir.parent / "outside"
    if name == "link" and not (server.save_dir / "link").exists():
        os.symlink(outside, server.save_dir / "link")
    before = set(os.listdir(server.save_dir.parent))
    for act in ("save", "restore"):
        r = action(server, 1, act, name)
        assert r.status_code == 400, (act, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert set(os.listdir(server.save_dir.parent)) == before
    assert not outside.exists()


def test_errors(server):
    assert action(server, 5, "save", "a.bin").status_code == 400
    assert action(server, 0, "explode", "a.bin").status_code == 400
    r = action(server, 0, "restore", "missing.bin")
    assert r.status_code == 400 and "missing" in r.json()["error"]["message"]
    (server.save_dir / "junk.bin").write_bytes(b"RXSL" + b"\x01" * 40)
    assert action(server, 1, "restore", "junk.bin").status_code == 400
    assert httpx.get(server.url + "/health").status_code == 200


def test_busy_slot_is_409(server):
    body = {"prompt": P, "n_predict": 3000, "ignore_eos": True, "stream": True, "id_slot": 1}

    def consume() -> None:
        with httpx.stream("POST", server.url + "/completion", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass

    t = threading.Thread(target=consume)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not httpx.get(server.url + "/slots").json()[1]["is_processing"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for act, name in (("save", "busy.bin"), ("restore", "conv.bin"), ("erase", None)):
            r = action(server, 1, act, name)
            assert r.status_code == 409, (act, r.text)
    finally:
        t.join()
    assert not (server.save_dir / "busy.bin").exists()


def test_without_slot_save_path_is_501(tiny_path, tmp_path):
    with running_server(["-m", tiny_path, "-np", "1", "-c", "256"],
                        str(tmp_path / "s.log")) as srv:
        r = action(srv, 0, "save", "a.bin")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
