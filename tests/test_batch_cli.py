"""``tokenq batch``: submit (with --wait, a progress bar and the files written), status, list, cancel;
bad input exits 2, a failed batch 1."""

from __future__ import annotations

import json

import pytest
from batch_helpers import chat_line, jsonl
from producer_helpers import run_cli, shared_worker


@pytest.fixture(scope="module")
def worker(request, redis_url, tiny_model_dir, tmp_path_factory):
    return shared_worker(request, redis_url, tiny_model_dir, tmp_path_factory)


def test_submit_wait_writes_the_output(worker, redis_url, capsys, tmp_path):
    prefix, _ = worker
    src = tmp_path / "in.jsonl"
    lines = [chat_line(f"q{i}", f"question {i}") for i in range(5)] + [chat_line("bad", "x", n=17)]
    src.write_bytes(jsonl(lines))
    out_path, err_path = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    code, out, err = run_cli(capsys, "batch", "submit", str(src), "--wait", "-o", str(out_path), "-e", str(err_path),
                         "--priority", "normal", "--metadata", "team=nlp", "--model-name", "tiny",
                         "--redis-url", redis_url, "--prefix", prefix)
    assert code == 0, err
    bid = out.strip()
    assert bid.startswith("batch_")
    assert "6/6" in err and "completed" in err and "req" in err  # the progress bar's last state
    got = [json.loads(x) for x in out_path.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in got) == [f"q{i}" for i in range(5)]
    assert all(x["response"]["body"]["object"] == "chat.completion" for x in got)
    (bad,) = [json.loads(x) for x in err_path.read_text().splitlines()]
    assert bad["custom_id"] == "bad" and bad["response"]["body"]["error"]["param"] == "n"
    code, out, _ = run_cli(capsys, "batch", "status", bid, "--json", "--redis-url", redis_url, "--prefix", prefix)
    b = json.loads(out)
    assert code == 0 and b["status"] == "completed" and b["priority"] == "normal" and b["metadata"] == {"team": "nlp"}
    assert b["request_counts"] == {"total": 6, "completed": 5, "failed": 1}


def test_status_list_cancel(redis_url, prefix, capsys, tmp_path):
    """No worker and no gateway here: the batch waits, and cancel moves it to cancelling."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([chat_line("a", "x")]))
    conn = ["--redis-url", redis_url, "--prefix", prefix]
    ids = [run_cli(capsys, "batch", "submit", str(src), *conn)[1].strip() for _ in range(2)]
    code, out, _ = run_cli(capsys, "batch", "list", *conn)
    assert code == 0 and [ln.split()[0] for ln in out.splitlines()] == ids[::-1]
    code, out, _ = run_cli(capsys, "batch", "list", "--limit", "1", "--json", *conn)
    page = json.loads(out)
    assert [b["id"] for b in page["data"]] == [ids[1]] and page["has_more"]
    code, out, _ = run_cli(capsys, "batch", "cancel", ids[0], *conn)
    assert code == 0 and "cancelling" in out
    code, out, err = run_cli(capsys, "batch", "status", ids[0], "-o", str(tmp_path / "o.jsonl"), *conn)
    assert code == 0 and "cancelling" in out and "its files come when it ends" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_input(worker, redis_url, capsys, tmp_path):
    prefix, _ = worker
    conn = ["--redis-url", redis_url, "--prefix", prefix, "--model-name", "tiny"]
    code, _, err = run_cli(capsys, "batch", "submit", str(tmp_path / "missing.jsonl"), *conn)
    assert code == 2 and "cannot read" in err
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"custom_id": "a", "url": "/v1/embeddings"}\n')
    code, _, err = run_cli(capsys, "batch", "submit", str(src), *conn)
    assert code == 2 and "--endpoint" in err
    src.write_bytes(jsonl([chat_line("a", "x")]))
    code, _, err = run_cli(capsys, "batch", "submit", str(src), "--metadata", "novalue", *conn)
    assert code == 2 and "KEY=VALUE" in err
    code, _, err = run_cli(capsys, "batch", "submit", str(src), "--completion-window", "1y", *conn)
    assert code == 2 and "completion_window" in err
    code, _, err = run_cli(capsys, "batch", "status", "batch_nope", *conn[:4])
    assert code == 2 and "no batch" in err
    src.write_bytes(jsonl([chat_line("a", "x"), b"{broken"]))
    code, _, err = run_cli(capsys, "batch", "submit", str(src), "--wait", *conn)
    assert code == 1 and "failed" in err and "line 2: invalid_json_line" in err
