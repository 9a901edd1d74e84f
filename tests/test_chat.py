"""``python -m infer.chat`` driven as a user would: in a pseudo-terminal, with ``--prompt``,
with piped stdin, and with bad input. Answers are checked token for token against a fresh
greedy generation of the same conversation by the library, so a stale or half-updated KV
cache between turns shows up as a different answer."""

from __future__ import annotations

import io
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from tiny import tiny_model

from infer.chat import main, parse_args
from medusa.chat.prepare import Style
from medusa.chat.session import Chat
from medusa.decoding.text import TextStream
from medusa.models.heads_config import save_heads
from medusa.models.loader import init_heads_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # generous: the CI machine's two cores may be busy
PROMPT = "you> "
STATS = re.compile(r"\[(\d+) tokens in [\d.]+ s · [\d.]+ tok/s · tau [-\d.]+ · [\d.]+ tok/pass · "
                   r"prefill (\d+) tokens in [\d.]+ s(?: · ([^\]]+))?\]")


@pytest.fixture
def engine(embedded):
    """The embedded model with fresh heads (conftest.py), the one the CLI loads."""
    return embedded


def chat_env(tmp_path: Path) -> dict[str, str]:
    inputrc = tmp_path / "inputrc"
    inputrc.write_text("set enable-bracketed-paste off\n")
    return dict(os.environ, NO_COLOR="1", TERM="dumb", INPUTRC=str(inputrc), TOKENIZERS_PARALLELISM="false",
                MEDUSA_CHAT_HISTORY=str(tmp_path / "history"))


def spawn(args: list[str], tmp_path: Path) -> pexpect.spawn:
    return pexpect.spawn(sys.executable, ["-m", "infer.chat", *args], cwd=str(REPO), env=chat_env(tmp_path),
                         encoding="utf-8", timeout=TIMEOUT, dimensions=(50, 250))


def run_cli(args: list[str], tmp_path: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infer.chat", *args], check=False, cwd=REPO, env=chat_env(tmp_path),
                          input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT)


def ask(child: pexpect.spawn, message: str) -> tuple[str, re.Match]:
    """Send a message at the prompt; return the printed answer and its stats line."""
    child.sendline(message)
    child.expect_exact(message + "\r\n")
    child.expect(STATS)
    answer = child.before.replace("\r\n", "\n").strip()
    stats = child.match
    child.expect_exact(PROMPT)
    return answer, stats


def template_ids(engine, messages: list[dict[str, str]]) -> list[int]:
    tok = engine.tokenizer
    return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]


# Chats whose answers are compared with the float32 fixture run in float32 too: the dtype pick
# may choose bfloat16, whose answers can differ from float32's, and whose prefill of a reused
# cache's new turn is not bit-identical to a fresh prefill of the whole prompt (its linear
# kernels change with the row count past 32 rows, medusa/runtime/kernels.py).
FLOAT32 = ("--dtype", "float32")


def fresh(engine, ids: list[int], max_new_tokens: int) -> list[int]:
    """The answer to ``ids`` decoded from scratch, no cache reused."""
    return engine.generate(ids, max_new_tokens=max_new_tokens, mode="baseline").tokens


def decode(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_two_turns_reuse_the_cache_and_mode_switches(engine, tmp_path):
    child = spawn(["--heads", "init", "--max-new-tokens", "12", *FLOAT32], tmp_path)
    child.expect_exact("heads   init")
    child.expect_exact("mode    hybrid")
    child.expect_exact(PROMPT)
    first, stats1 = ask(child, "Name a fruit.")
    child.sendline("/mode baseline")
    child.expect_exact("[mode: baseline]")
    child.sendline("/mode bogus")
    child.expect_exact("error: unknown mode 'bogus'")
    second, stats2 = ask(child, "And a vegetable?")
    child.sendline("/stats")
    child.expect_exact("session: 2 answer(s)")
    child.expect_exact("decoding: mode baseline")
    saved = tmp_path / "chat.json"
    child.sendline(f"/save {saved}")
    child.expect_exact("[saved 2 turn(s)")
    child.sendline("/reset")
    child.expect_exact("[conversation cleared]")
    child.sendline("/stats")
    child.expect_exact("conversation: 0 turn(s), 0 tokens cached")
    child.sendline("/help")
    child.expect_exact("/mode NAME")
    child.sendline("/nonsense")
    child.expect_exact("error: unknown command /nonsense")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    t1, t2 = json.loads(saved.read_text())["turns"]
    # Turn 1 is the chat template of the message; turn 2 carries turn 1 exactly as generated.
    assert t1["prompt_ids"] == template_ids(engine, [{"role": "user", "content": "Name a fruit."}])
    history = t1["prompt_ids"] + t1["answer_ids"]
    assert t2["prompt_ids"][: len(history)] == history
    two_turns = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": t1["answer"]},
                 {"role": "user", "content": "And a vegetable?"}]
    assert engine.tokenizer.decode(t2["prompt_ids"]) == engine.tokenizer.apply_chat_template(
        two_turns, add_generation_prompt=True, tokenize=False)
    # Only the new turn was prefilled (plus the last answer token, whose KV the cache lacks).
    assert int(stats1.group(2)) == len(t1["prompt_ids"])
    assert int(stats2.group(2)) == len(t2["prompt_ids"]) - len(history) + 1
    # Both answers (hybrid mode, then baseline on the reused cache) equal fresh decoding.
    for turn, printed in ((t1, first), (t2, second)):
        assert turn["answer_ids"] == fresh(engine, turn["prompt_ids"], 12)
        assert printed == decode(engine, turn["answer_ids"])


def test_ctrl_c_stops_the_answer_and_the_session_goes_on(engine, tmp_path):
    child = spawn(["--max-new-tokens", "24", *FLOAT32], tmp_path)
    child.expect_exact(PROMPT)
    message = "Write a long story about a dragon."
    child.sendline(message)
    child.expect_exact(message + "\r\n")
    child.expect(r"\w")  # the answer has started streaming
    child.sendintr()
    child.expect(STATS)
    assert child.match.group(3) == "stopped"
    stopped_after = int(child.match.group(1))
    assert 1 <= stopped_after < 24
    child.expect_exact(PROMPT)
    ask(child, "Give it a title.")
    saved = tmp_path / "chat.json"
    child.sendline(f"/save {saved}")
    child.expect_exact("[saved 2 turn(s)")
    child.expect_exact(PROMPT)  # Ctrl-D reaches readline only once it reads the terminal
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    t1, t2 = json.loads(saved.read_text())["turns"]
    assert t1["finish_reason"] == "stopped" and len(t1["answer_ids"]) == stopped_after
    # The interrupted answer stays in the conversation, token for token, and the cache
    # after the interruption gives the same next answer as decoding from scratch.
    assert t2["prompt_ids"][: len(t1["prompt_ids"]) + stopped_after] == t1["prompt_ids"] + t1["answer_ids"]
    assert t2["answer_ids"] == fresh(engine, t2["prompt_ids"], 24)


def test_prompt_and_piped_stdin_answer_once(engine, tmp_path):
    system = [{"role": "system", "content": "You answer in one word."}]
    for args, stdin, messages in (
        (["--prompt", "What is the capital of France?"], None, [{"role": "user", "content": "What is the capital of France?"}]),
        (["--system", system[0]["content"]], "Name three colours.\n", system + [{"role": "user", "content": "Name three colours."}]),
    ):
        done = run_cli([*args, "--max-new-tokens", "12", *FLOAT32], tmp_path, stdin)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert STATS.search(done.stderr)
        expected = fresh(engine, template_ids(engine, messages), 12)
        assert done.stdout.strip() == decode(engine, expected)  # stdout holds the answer only


def test_eagle_heads_chat_with_their_dynamic_tree_in_the_banner(engine, tmp_path):
    from medusa.api import SHIPPED_EAGLE_HEADS

    message = "Name three rivers."
    done = run_cli(["--heads", str(SHIPPED_EAGLE_HEADS), "--prompt", message, "--max-new-tokens", "16", *FLOAT32],
                   tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    # the tree's size, and the smaller sizes it switches to at longer contexts where the plan sized any
    assert re.search(r"heads .* eagle \(eagle1\), 3 draft steps trained · proposal [^:]+: dynamic tree "
                     r"\(\d+ nodes, depth \d+, top-\d+(; from \d+ tokens [^)]+)?\)",
                     done.stderr), done.stderr
    assert "mode    hybrid" in done.stderr  # the eagle tree plus the lookup chain
    if "lookup chain" in done.stderr:  # sized with a chain here: the shipped heads' n-gram table backs it
        assert re.search(r"lookup chain \(else from [\d,]+ n-grams of [\d,]+ answers\)", done.stderr), done.stderr
    expected = fresh(engine, template_ids(engine, [{"role": "user", "content": message}]), 16)
    assert done.stdout.strip() == decode(engine, expected)
    default = run_cli(["--prompt", message, "--max-new-tokens", "16", *FLOAT32], tmp_path)  # the EAGLE-3 heads
    assert default.returncode == 0, default.stderr
    assert re.search(r"heads .* eagle3 \(layers 2, 15, 27, 8,192-token draft vocabulary\), 7 draft steps trained",
                     default.stderr), default.stderr
    assert default.stdout.strip() == decode(engine, expected)


def test_banner_says_which_dtype_was_picked_and_why(capsys):
    assert main(["--prompt", "Hi", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    # the plan's dtype decision, with the rule's reason (medusa/autotune/dtype.py)
    assert re.search(r"dtype\s+(float32|bfloat16)\b.*(AMX|exact|bfloat16)", err), err


def test_bad_path_is_one_line_error_with_exit_code(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "no-such-model"), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model not found" in errors[0]


def test_out_of_memory_is_one_line_and_the_session_goes_on(tmp_path):
    # The machine plan timed and cached first: timed inside the chat, its passes would leave
    # freed memory the allocator keeps (counted in VmSize below), room for the prompt's cache.
    assert run_cli(["--prompt", "hi", "--max-new-tokens", "1"], tmp_path).returncode == 0
    child = spawn(["--max-new-tokens", "4"], tmp_path)
    child.expect_exact(PROMPT)
    # Cap the chat's address space a little above what it uses now: a 7,000-token prompt's
    # KV cache (~320 MB) cannot fit, a short answer (bfloat16 draft heads' oneDNN calls
    # included) can.
    vm_kb = next(int(line.split()[1]) for line in Path(f"/proc/{child.pid}/status").read_text().splitlines()
                 if line.startswith("VmSize"))
    resource.prlimit(child.pid, resource.RLIMIT_AS, (vm_kb * 1024 + 100 * 2**20, resource.RLIM_INFINITY))
    child.sendline("hello " * 7000)
    child.expect_exact("error: out of memory")
    printed = child.before
    child.expect_exact(PROMPT)
    assert "Traceback" not in printed + child.before and "\n" not in child.before.strip()  # one line
    # the session goes on: with the cap lifted (how much a short answer needs under it depends on
    # the kernels the machine plan picked), the next message is answered
    resource.prlimit(child.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    ask(child, "Hi")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def draft_with_other_tokenizer(folder: Path) -> Path:
    """A tiny model folder whose tokenizer is not the embedded model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("llama", vocab_size=49152)
    vocab = {f"w{i}": i for i in range(96)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", ["model", "heads", "other-model-heads", "mode", "too-long", "empty",
                                  "draft-tokenizer", "tree", "tree-for-eagle-heads", "device", "device-name"])
def test_bad_input_is_one_line_error(case, tmp_path, capsys):
    args = {
        "model": ["--model", str(tmp_path / "missing")],
        "heads": ["--heads", str(tmp_path / "missing")],
        "mode": ["--mode", "bogus"],
        "too-long": ["--max-context", "48", "--max-new-tokens", "8", "--prompt", "word " * 60],
        "empty": ["--prompt", "   "],
        "tree": ["--mode", "medusa", "--tree", str(tmp_path / "missing.json")],
        "tree-for-eagle-heads": ["--tree", "cpu"],  # the default heads are eagle heads: a tree would be ignored
        "device": ["--device", "cuda:99"],  # no such GPU here, nor on a GPU machine
        "device-name": ["--device", "gpu0"],
    }.get(case, [])
    if case == "other-model-heads":
        args = ["--heads", str(save_heads(init_heads_for(tiny_model("llama")), tmp_path / "heads"))]
    if case == "draft-tokenizer":
        args = ["--draft", str(draft_with_other_tokenizer(tmp_path / "draft")), "--mode", "draft"]
    expected = {"model": "model not found", "heads": "heads not found", "other-model-heads": "heads trained for",
                "mode": "unknown mode 'bogus'", "too-long": "shorten it", "empty": "prompt is empty",
                "draft-tokenizer": "different tokenizer", "tree": "not found",
                "tree-for-eagle-heads": "drop the tree, or use Medusa heads (mode medusa)",
                "device": "device 'cuda:99' is not available", "device-name": "unknown device 'gpu0'"}[case]
    if "--prompt" not in args:
        args += ["--prompt", "hi"]
    assert main(args) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], err


def test_oldest_turns_are_dropped_to_fit_the_context(engine, capsys):
    window = 64  # the system prompt and one short exchange fill it
    chat = Chat(engine, parse_args(["--max-new-tokens", "8"]), "baseline", Style(False), window)
    messages = ["Hi.", "Name a colour.", "Name an animal.", "Name a city."]
    drops = 0
    for message in messages:
        before = list(chat.conversation.turns)
        out = io.StringIO()
        assert chat.answer(message, out) == 0
        turn = chat.conversation.turns[-1]
        assert len(turn.prompt_ids) + 8 <= window
        assert turn.answer_ids == fresh(engine, turn.prompt_ids, 8)
        assert out.getvalue().strip() == decode(engine, turn.answer_ids)
        if "oldest turn(s) to fit the 64-token context window" in capsys.readouterr().err:
            drops += 1
            # The prompt is the template of the turns kept, the oldest ones left out.
            kept = chat.conversation.turns[:-1]
            assert len(kept) < len(before) and kept == before[len(before) - len(kept):]
            msgs = [m for t in kept for m in ({"role": "user", "content": t.user},
                                              {"role": "assistant", "content": t.answer})]
            assert turn.prompt_ids == template_ids(engine, msgs + [{"role": "user", "content": message}])
    assert drops >= 1 and len(chat.conversation.turns) < len(messages)


def test_the_chat_prints_multibyte_characters_and_spaces_whole(engine):
    tok = engine.tokenizer
    text = "Café naïve — 你好, 世界! 🙂🚀  two  spaces\n new line"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    decoder = TextStream(tok)  # the chat's decoder
    pieces = [decoder.push([t]) for t in ids]
    assert len(ids) > len(text.split())  # some characters span several tokens
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_keeps_a_state_the_next_turn_can_reuse(engine):
    ids = template_ids(engine, [{"role": "user", "content": "Tell me about the moon."}])
    generation = engine.stream(ids, max_new_tokens=40, mode="medusa")
    got = next(generation) + next(generation)
    generation.stop()
    got += [t for chunk in generation for t in chunk]
    result = generation.result
    assert result.finish_reason == "stopped" and result.tokens == got and len(got) < 40
    assert result.state.tokens == ids + got
    follow = ids + got + engine.tokenizer("<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n",
                                          add_special_tokens=False)["input_ids"]
    again = engine.generate(follow, max_new_tokens=10, mode="medusa", state=result.state)
    assert again.stats.prefill_tokens == len(follow) - len(ids + got) + 1
    assert again.tokens == fresh(engine, follow, 10)


def test_show_accepted_colours_the_drafted_tokens(engine):
    chat = Chat(engine, parse_args(["--max-new-tokens", "16", "--show-accepted"]), "lookup", Style(False, True), 8192)
    out = io.StringIO()
    # Asked to repeat its prompt, the model copies it, and prompt lookup drafts the copy.
    assert chat.answer("Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.", out) == 0
    coloured = out.getvalue()
    plain = re.sub(r"\x1b\[(32|0)m", "", coloured)
    turn, stats = chat.conversation.turns[-1], chat.last.stats
    assert plain.strip() == decode(engine, turn.answer_ids)
    segments = re.findall(r"\x1b\[32m(.*?)\x1b\[0m", coloured, flags=re.DOTALL)
    assert sum(stats.accepted) > stats.steps  # some drafted tokens were accepted ...
    assert segments and all(segments) and len(segments) <= stats.steps  # ... and coloured, one run per step at most
    assert turn.answer_ids == fresh(engine, turn.prompt_ids, 16)


@pytest.mark.peers
def test_compile_compiles_every_pass_size_before_the_first_answer(tmp_path):
    # a tiny target: compiling its two layers takes seconds, the flow is the same as the
    # embedded model's 30 (tests/test_static_cache.py compiles those)
    from train_fixtures import tiny_target

    folder = tiny_target(tmp_path / "target")
    args = ["--model", str(folder), "--mode", "baseline", "--prompt", "count from three please",
            "--max-new-tokens", "12"]
    done = run_cli(["--compile", *args], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    compiled = next(i for i, line in enumerate(lines) if re.match(r"1 pass size ready in [\d.]+ s", line))
    assert any(re.match(r"\s+1 rows: [\d.]+ s", line) for line in lines[:compiled])
    assert STATS.search("\n".join(lines[compiled:]))  # the answer comes after the compilation
    eager = run_cli(args, tmp_path)
    assert eager.returncode == 0, eager.stderr
    assert done.stdout.strip() == eager.stdout.strip() and done.stdout.strip()


def test_a_model_without_a_chat_template_chats_through_chat_template(tmp_path, capsys):
    """A base model's tokenizer has no template: one line names --chat-template, and with a
    template file the same model answers."""
    folder = draft_with_other_tokenizer(tmp_path / "base")
    args = ["--model", str(folder), "--heads", "init", "--mode", "baseline", "--max-new-tokens", "4",
            "--prompt", "w1 w2 w3"]
    assert main(args) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "has no chat template: pass --chat-template FILE" in errors[0], errors
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    assert main([*args, "--chat-template", str(template)]) == 0
    assert "error" not in capsys.readouterr().err
