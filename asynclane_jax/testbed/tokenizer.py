"""The testbed's word-level tokenizer, in Hugging Face format.

Every number 0..99, word, step label and "\\n" is a single token, so the canvas holds
many lines cheaply. The same vocabulary is available two ways:

  * `encode` / `decode_ids`: plain-Python lookups used by the trainer (fast, no deps);
  * `save_tokenizer(folder)`: tokenizer.json + tokenizer_config.json loadable with
    transformers' PreTrainedTokenizerFast, copied into every shipped model folder.

Chat format (the shipped models are "instruct" models):  <|user|> PROBLEM <|assistant|>
"""

from __future__ import annotations

import functools
import json
import pathlib

from asynclane_jax.testbed import words as task_words

EOS = "<|endoftext|>"  # end of text; also the padding token, as in LLaDA
MASK = "<|mdm_mask|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
UNK = "<|unk|>"
SPECIALS = (EOS, MASK, USER, ASSISTANT, UNK)
NEWLINE = "\n"

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
    "{% else %}<|assistant|> {{ m['content'] }} <|endoftext|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """The ordered token list; ids are positions in it (stable: never reorder)."""
    words = [NEWLINE]
    words += [str(i) for i in range(100)]
    words += [task_words.label(i) for i in range(16)]
    words += ["+", "-", "=", ":", ";", ".", "?", ",", "answer", "has", "how", "many",
              "print"]
    words += list(task_words.NAMES) + list(task_words.ITEMS) + list(task_words.GAIN_VERBS)
    words += list(task_words.LOSS_VERBS) + list(task_words.VARIABLES)
    # Appended for the long task families (ids above stay what the first models have).
    words += [task_words.label(i) for i in range(16, task_words.MAX_LABEL + 1)]
    words += list(task_words.CONNECTIVES) + list(task_words.CONSEQUENCES)
    words += list(task_words.LONG_WORDS)
    # Appended for the task set v3 (walk, table).
    words += list(task_words.WALK_TABLE_WORDS)
    return tuple(SPECIALS) + tuple(words)


FIRST_VOCAB_SIZE = 159  # the vocabulary of the task set "v1" (its models' embeddings)


@functools.lru_cache(maxsize=1)
def token_to_id() -> dict[str, int]:
    return {t: i for i, t in enumerate(vocabulary())}


def vocab_size() -> int:
    return len(vocabulary())


def special_ids() -> dict[str, int]:
    ids = token_to_id()
    return {"eos_token_id": ids[EOS], "pad_token_id": ids[EOS], "mask_token_id": ids[MASK]}


def split_words(text: str) -> list[str]:
    return [t for t in text.replace("\n", " \n ").split(" ") if t]


def encode(text: str) -> list[int]:
    ids = token_to_id()
    try:
        return [ids[t] for t in split_words(text)]
    except KeyError as e:
        raise ValueError(f"token {e.args[0]!r} is not in the testbed vocabulary") from None


def decode_tokens(token_ids) -> list[str]:
    vocab = vocabulary()
    return [vocab[int(i)] if 0 <= int(i) < len(vocab) else UNK for i in token_ids]


def decode_ids(token_ids) -> str:
    """Token ids to text with single spaces ("\\n" tokens stay newlines)."""
    return " ".join(decode_tokens(token_ids))


def prompt_ids(problem_text: str) -> list[int]:
    """The chat-formatted prompt: <|user|> PROBLEM <|assistant|>."""
    ids = token_to_id()
    return [ids[USER]] + encode(problem_text) + [ids[ASSISTANT]]


def build_hf_tokenizer():
    """A `tokenizers.Tokenizer` equivalent to `encode` / `decode_ids`."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel(vocab=token_to_id(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t\r]+"), behavior="removed"),
        pre_tokenizers.Split(NEWLINE, behavior="isolated"),
    ])
    tok.add_special_tokens(list(SPECIALS))
    return tok


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    """The vocabulary as a transformers PreTrainedTokenizerFast (what `load` gives for a
    shipped model), for callers that have no tokenizer of their own."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build_hf_tokenizer(), eos_token=EOS,
                                   pad_token=EOS, mask_token=MASK, unk_token=UNK)


def save_tokenizer(folder) -> pathlib.Path:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_hf_tokenizer().save(str(folder / "tokenizer.json"))
    specials = {"eos_token": EOS, "pad_token": EOS, "mask_token": MASK, "unk_token": UNK}
    config = dict(specials, tokenizer_class="PreTrainedTokenizerFast",
                  chat_template=CHAT_TEMPLATE, model_max_length=1024,
                  clean_up_tokenization_spaces=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return folder
