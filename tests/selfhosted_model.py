"""A tiny Llama that `transformers serve` can load from a folder, built here (no hub access).

Its attention and MLP write nothing, so each next token depends only on the last one (a bigram
table in the embeddings and the head): after the chat template's "<|im_start|>assistant\\n" it says
"4", then "<|im_end|>". So every answer is the same short, finished one, and a CPU answers it at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# A generation prompt that drops ChatML's newline: the server and draftgen render the same prompt, but
# draftgen's answer span ("\n4<|im_end|>") is one token longer than what the model generated.
CHATML_NO_NEWLINE = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant{% endif %}")


def build_tiny_model(folder: Path, template: str = CHATML) -> Path:
    """Tokenizer (byte-level BPE, ChatML template) and random-free Llama weights in `folder`.

    With another `template` the last token of its generation prompt also leads to "4"."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["What is 2+2? Answer in one word.", "Question: explain item 4.", "user assistant system"] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = template
    tok.save_pretrained(folder)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    newline = bpe.token_to_id("Ċ")  # ByteLevel's "\n": the last token of the generation prompt
    four = bpe.token_to_id("4")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                         eos_token_id=eos, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.norm, *(m for layer in model.model.layers
                                         for m in (layer.input_layernorm, layer.post_attention_layernorm))):
            norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, 0] = 1.0            # every token: "then end the turn"
        emb[newline] = 0.0
        emb[newline, 1] = 1.0      # "\n": "then say 4"
        last = tok.encode("<|im_start|>assistant", add_special_tokens=False)[-1]
        if template != CHATML and last != newline:
            emb[last] = 0.0
            emb[last, 1] = 1.0     # the generation prompt's own last token: "then say 4"
        head[eos, 0] = 8.0
        head[four, 1] = 8.0        # RMSNorm scales a one-hot by 8: logits 64 against 0
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False).save_pretrained(folder)
    return folder


# Qwen3-style: the model opens `<think>` itself; the final turn renders `reasoning_content` in it.
CHATML_THINK = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                "{% if message['role'] == 'assistant' and message.get('reasoning_content') is not none %}"
                "<think>{{ message['reasoning_content'] }}</think>{% endif %}{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_reasoning_model(folder: Path) -> Path:
    """A tiny Qwen2 (so `transformers serve` runs its Qwen reasoning parser on it) that answers every
    prompt "<think> is</think> 4<|im_end|>": reasoning and content that begin with a space. " 4" comes as
    "Ġ" then "4", the ids transformers' Qwen2Tokenizer (digits split off) gives that text: a model only
    generates what its serving tokenizer produces."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["What is 2+2? Answer in one word.", "Question: explain item 4.", "user assistant system"] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML_THINK
    tok.save_pretrained(folder)
    ids = {t: bpe.token_to_id(t) for t in ("Ċ", "<think>", "Ġis", "</think>", "Ġ", "4", "<|im_end|>")}
    assert all(i is not None for i in ids.values()), ids
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                         eos_token_id=ids["<|im_end|>"], pad_token_id=tok.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    chain = ["<|im_end|>", "<think>", "Ġis", "</think>", "Ġ", "4"]  # dimension k: "then say chain[k]"
    after = {"Ċ": 1, "<think>": 2, "Ġis": 3, "</think>": 4, "Ġ": 5}   # each token's next, as a dimension
    with torch.no_grad():
        head = _routed(model, {ids[t]: k for t, k in after.items()})
        for k, t in enumerate(chain):
            head[ids[t], k] = 8.0
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=tok.pad_token_id,
                     do_sample=False).save_pretrained(folder)
    return folder


def _routed(model: Any, after: dict[int, int]) -> Any:
    """Zero `model`'s weights (under torch.no_grad), norms at 1, and embed each token of `after` as a one-hot
    on its dimension (every other token on dimension 0): the hidden state names the next token's dimension,
    whatever the context. Returns lm_head's weight, for the caller to map dimensions to tokens."""
    for p in model.parameters():
        p.zero_()
    for norm in (model.model.norm, *(m for layer in model.model.layers
                                     for m in (layer.input_layernorm, layer.post_attention_layernorm))):
        norm.weight.fill_(1.0)
    emb = model.model.embed_tokens.weight
    emb[:, 0] = 1.0
    for i, k in after.items():
        emb[i] = 0.0
        emb[i, k] = 1.0
    return model.lm_head.weight


# The generation prompt opens the reasoning (as QwQ's and Qwen3-Thinking's do): the model's first token
# is already inside `<think>`; the final turn renders `reasoning_content` there.
CHATML_THINK_OPEN = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                     "{% if message['role'] == 'assistant' %}<think>{{ message.get('reasoning_content') or '' }}"
                     "</think>{% endif %}{{ message['content'] }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}")
# Made-up two-syllable words ("bako", "deli", ...), each one token with its leading space.
WORDS = [c1 + v1 + c2 + v2 for c1 in "bdfgklmnprstvz" for v1 in "aeiou" for c2 in "bdklmnprst" for v2 in "aio"][::3]


def build_tiny_sampling_reasoning_model(folder: Path) -> Path:
    """A tiny Qwen2 behind a generation prompt that opens `<think>`. Greedy, it closes the reasoning and
    ends its turn at once ("</think><|im_end|>": an answer empty on both sides); sampled, it almost
    always says one word with its leading space in the reasoning and another in the content: "<think>
    bako</think> deli<|im_end|>". Each step picks the end (`</think>`, `<|im_end|>`) at logit 8 or one
    of about 300 words at 7.992, so greedy ends and a sample talks (about 1 in 300 ends)."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["What is 2+2? Answer in one word.", "Question: explain item 4.", "user assistant system",
              " ".join(WORDS)] * 40
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=6000, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML_THINK_OPEN
    tok.save_pretrained(folder)
    # The words, each one token with its space, as the served tokenizer encodes " word".
    words = [bpe.token_to_id("Ġ" + w) for w in WORDS]
    words = [i for w, i in zip(WORDS, words) if i is not None and tok.encode(" " + w, add_special_tokens=False) == [i]]
    assert len(words) >= 600, len(words)
    thinking, answering = words[0::2], words[1::2]  # reasoning words lead to `</think>`, content words end the turn
    think, close, eos = (bpe.token_to_id(t) for t in ("<think>", "</think>", "<|im_end|>"))
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                         eos_token_id=eos, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    # Each token's next, as a dimension: 0 end the turn; 1 `</think>` or a reasoning word; 2 `</think>`;
    # 3 the end of turn or a content word.
    after = {think: 1, **{w: 2 for w in thinking}, close: 3}
    with torch.no_grad():
        head = _routed(model, after)
        head[eos, 0] = 8.0                 # RMSNorm scales a one-hot by 8: logit 64 against 0
        head[close, 1] = 1.0               # logit 8 ...
        head[thinking, 1] = 0.999          # ... each word a hair below: greedy closes, a sample thinks
        head[close, 2] = 8.0
        head[eos, 3] = 1.0
        head[answering, 3] = 0.999
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=True, top_k=0).save_pretrained(folder)
    return folder
