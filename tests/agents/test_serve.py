"""`rlloom serve` as a user starts it: a process serving the tiny model that the official `openai`
client talks to, whose greedy answers are `rlloom eval`'s; a missing package or a bad port is one
line naming the fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import openai

from rlloom.cli import main


def test_serve_answers_the_openai_client_as_eval_does(tiny_checkpoint, tmp_path, capsys):
    prompts = ["What is 2 + 3?", "Name a color.", "hello"]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "5"}) + "\n" for p in prompts))
    responses = tmp_path / "answers.jsonl"
    assert main(["eval", str(tiny_checkpoint), str(data), "--responses", str(responses)]) == 0
    expected = [json.loads(x)["responses"][0] for x in responses.read_text().splitlines()]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "rlloom.cli", "serve", str(tiny_checkpoint), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = ""
        for line in proc.stdout:  # the first line says where it listens
            if "rlloom serve:" in line:
                break
        url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [tiny_checkpoint.name]
        answers = [
            client.chat.completions.create(
                model=tiny_checkpoint.name, messages=[{"role": "user", "content": p}], temperature=0
            )
            .choices[0]
            .message.content
            for p in prompts
        ]
        assert answers == expected
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_serve_refuses_a_bad_port_in_one_line(tiny_checkpoint, capsys):
    assert main(["serve", str(tiny_checkpoint), "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlloom: error: --port=70000")


def test_a_missing_server_package_names_the_extra(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` raises ImportError
    assert main(["serve", str(tiny_checkpoint), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install "rlloom[serve]"' in err[0]
    args = [
        f"model.path={tiny_checkpoint}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "rollout.agent=agent_fns:two_turns",
    ]
    assert main(["train", "arithmetic_smoke", *args, f"reward.import_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install "rlloom[serve]"' in err[0], err
