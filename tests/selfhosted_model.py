"""A tiny Llama that `transformers serve` can load from a folder, built here (no hub access).

Its attention and MLP write nothing, so each next token depends only on the last one (a bigram
table in the embeddings and the head): after the chat template's "<|im_start|>assistant\\n" it says
"4", then "<|im_end|>". So every answer is the same short, finished one, and a CPU answers it at once.
"""

from __future__ import annotations

from pathlib import Path

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
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.norm, *(m for layer in model.model.layers
                                         for m in (layer.input_layernorm, layer.post_attention_layernorm))):
            norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, 0] = 1.0
        for t, k in after.items():
            emb[ids[t]] = 0.0
            emb[ids[t], k] = 1.0
        for k, t in enumerate(chain):
            head[ids[t], k] = 8.0
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=tok.pad_token_id,
                     do_sample=False).save_pretrained(folder)
    return folder
