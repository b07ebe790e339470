#!/usr/bin/env python3
"""Writes the tiny llama-architecture GGUF model that the real-backend tests serve with
llama.cpp's OpenAI server (`python -m llama_cpp.server`, from llama-cpp-python).

No weights can be downloaded where the tests run, so the model is made here: random weights
from a fixed seed (the same seed gives the same file, byte for byte), a byte-level GPT-2
tokenizer (the 256 byte tokens, a few merges, the control tokens of a small chat template).
It knows no language; it exists to make a real inference server stream real tokens with
real logprobs through haltd.

Streams must run as long as a test asks (`max_tokens`), so the model practically never ends
one by itself: the output rows of EOS and of every control token are zero (logit 0), while
the others are random with a spread (`--logit-scale`) that puts well over 40 of them above 0
for every position, so the server's default top-k of 40 never keeps EOS. Random weights also
give what a real model gives: single bytes of a multi-byte character (byte fragments).

Usage: make_model.py --out FILE [--seed N]   (needs the `gguf` and `numpy` packages)
"""

import argparse
import os
import sys

import numpy as np

try:
    import gguf
except ImportError as e:  # pragma: no cover - environment problem
    sys.stderr.write("make_model.py: cannot import gguf (%s); `pip install gguf numpy`\n" % e)
    sys.exit(1)

N_EMBD = 64
N_HEAD = 4
N_FF = 128
N_LAYER = 2
N_CTX_TRAIN = 2048

# The chat template's markers and the ends of a sequence, all control tokens.
CONTROL = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BOS, EOS = "<|bos|>", "<|eos|>"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A few merges, so that some tokens are longer than one byte (as in any real vocabulary).
MERGE_PAIRS = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"),
    ("Ġ", "a"), ("r", "e"), ("Ġ", "s"), ("A", "K"), ("AK", "I"), ("AKI", "A"), ("e", "n"),
    ("Ġ", "w"), ("o", "r"), ("Ġ", "c"), ("e", "s"), ("i", "s"), ("Ġ", "i"),
]


def byte_tokens():
    """GPT-2's byte-to-unicode mapping: the 256 byte-level token texts, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def vocabulary():
    tokens = byte_tokens()
    types = [gguf.TokenType.NORMAL] * len(tokens)
    merges = []
    for a, b in MERGE_PAIRS:
        merges.append(a + " " + b)
        tokens.append(a + b)
        types.append(gguf.TokenType.NORMAL)
    for c in CONTROL:
        tokens.append(c)
        types.append(gguf.TokenType.CONTROL)
    return tokens, types, merges


def tensors(rng, n_vocab, controls, logit_scale):
    """(name, float32 array of numpy shape (out, in)) for every tensor of the model."""
    def mat(rows, cols, scale=None):
        s = (1.0 / np.sqrt(cols)) if scale is None else scale
        return (rng.standard_normal((rows, cols)) * s).astype(np.float32)

    out = [("token_embd.weight", mat(n_vocab, N_EMBD, 1.0))]
    for i in range(N_LAYER):
        p = "blk.%d." % i
        out += [
            (p + "attn_norm.weight", np.ones(N_EMBD, dtype=np.float32)),
            (p + "attn_q.weight", mat(N_EMBD, N_EMBD)),
            (p + "attn_k.weight", mat(N_EMBD, N_EMBD)),
            (p + "attn_v.weight", mat(N_EMBD, N_EMBD)),
            (p + "attn_output.weight", mat(N_EMBD, N_EMBD)),
            (p + "ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32)),
            (p + "ffn_gate.weight", mat(N_FF, N_EMBD)),
            (p + "ffn_up.weight", mat(N_FF, N_EMBD)),
            (p + "ffn_down.weight", mat(N_EMBD, N_FF)),
        ]
    # The final norm makes the hidden state of unit RMS, so a row of N(0, (scale/8)^2) gives
    # logits of spread about `logit_scale`; the control rows (EOS among them) give 0.
    head = mat(n_vocab, N_EMBD, logit_scale / np.sqrt(N_EMBD))
    head[controls, :] = 0.0
    out += [("output_norm.weight", np.ones(N_EMBD, dtype=np.float32)), ("output.weight", head)]
    return out


def write(path, seed, logit_scale):
    rng = np.random.default_rng(seed)
    tokens, types, merges = vocabulary()
    controls = [tokens.index(c) for c in CONTROL]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("haltd-tiny-%d" % seed)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(BOS))
    w.add_eos_token_id(tokens.index(EOS))
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, data in tensors(rng, len(tokens), controls, logit_scale):
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the .gguf file to write")
    ap.add_argument("--seed", type=int, default=17, help="seed of the random weights")
    ap.add_argument("--logit-scale", type=float, default=4.0,
                    help="spread of the logits of the non-control tokens")
    a = ap.parse_args()
    tmp = a.out + ".tmp"
    write(tmp, a.seed, a.logit_scale)
    os.replace(tmp, a.out)  # never a half-written model at the cached path


if __name__ == "__main__":
    main()
