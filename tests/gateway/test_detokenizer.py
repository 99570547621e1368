from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.common.detokenizer import IncrementalDetokenizer

TEXT = "Hi 😀 wörld 🎉 日本語 done"


def _stream(tokenizer, ids, sizes=None, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    chunks, i = [], 0
    for size in sizes or [1] * len(ids):
        chunks.append(detok.add(ids[i:i + size]))
        i += size
        if i >= len(ids):
            break
    if i < len(ids):
        chunks.append(detok.add(ids[i:]))
    chunks.append(detok.flush())
    return detok, chunks


def test_never_emits_partial_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, chunks = _stream(tokenizer, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == detok.text == TEXT


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_any_batching_gives_the_full_decode(tokenizer, sizes):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    _, chunks = _stream(tokenizer, ids, sizes)
    assert "".join(chunks) == TEXT and all("\ufffd" not in c for c in chunks)


def test_stop_string_is_withheld_and_excluded(tokenizer):
    ids = tokenizer.encode("Hello wörld, the end", add_special_tokens=False)
    detok, chunks = _stream(tokenizer, ids, stop=["wörld", "zzz"])
    assert detok.stopped and detok.stop_reason == "wörld"
    assert detok.text == "Hello " == "".join(chunks)
    assert all(not c.endswith(("w", "wö", "wör")) for c in chunks)


def test_stop_string_included_on_request(tokenizer):
    ids = tokenizer.encode("Hello wörld, the end", add_special_tokens=False)
    detok, chunks = _stream(tokenizer, ids, stop=["wörld"], include_stop_str_in_output=True)
    assert "".join(chunks) == detok.text == "Hello wörld"


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("abc def ghi", add_special_tokens=False)
    detok, _ = _stream(tokenizer, ids, [len(ids)], stop=["ghi", "def"])
    assert detok.stop_reason == "def" and detok.text == "abc "


def test_held_prefix_released_at_flush(tokenizer):
    ids = tokenizer.encode("the end wö", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["wörld"])
    assert detok.add(ids) == "the end "
    assert detok.flush() == "wö"
    assert not detok.stopped and detok.text == "the end wö"


def test_output_cut_inside_a_character_ends_before_it(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]
    assert tokenizer.decode(ids).endswith("\ufffd")
    detok, chunks = _stream(tokenizer, ids)
    assert "".join(chunks) == detok.text == "ok "


def test_no_tokens_after_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["b"])
    detok.add(tokenizer.encode("ab", add_special_tokens=False))
    assert detok.add(tokenizer.encode("cd", add_special_tokens=False)) == "" and detok.flush() == ""
    assert detok.text == "a"


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = [*tokenizer.encode("hi", add_special_tokens=False), tokenizer.eos_token_id]
    assert "".join(_stream(tokenizer, ids)[1]) == "hi"
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=False)[1]) == "hi</s>"


def test_prompt_context_keeps_output_only(tokenizer):
    prompt = tokenizer.encode("Hello", add_special_tokens=True)
    ids = tokenizer.encode(" wörld", add_special_tokens=False)
    _, chunks = _stream(tokenizer, ids, prompt_token_ids=prompt)
    assert "".join(chunks) == " wörld"
