"""Megatron-LM's SFTTokenizer (``--tokenizer-type SFTTokenizer``): a Hugging Face tokenizer
that turns a conversation into tokens through a prompt format, and marks which of them
the loss trains on.

A conversation is a list of ``{"role": ..., "content": ...}`` messages (system, user,
assistant, tool). ``--sft-tokenizer-prompt-format`` picks how it is written out:

* ``nemotron-h-aligned`` (Megatron-LM's default): ``<SPECIAL_10>System\\n{system}\\n``,
  ``<SPECIAL_11>User\\n{user}\\n<SPECIAL_11>Assistant\\n``, ``{assistant}\\n``; pads with
  ``<SPECIAL_233>``;
* ``nemotron-nano-v2``: ``<SPECIAL_10>System\\n..``, ``<SPECIAL_11>User\\n..``,
  ``<SPECIAL_11>Assistant\\n{assistant}\\n<SPECIAL_12>\\n``, ``/think`` and ``/no_think``
  taken out of system and user texts; the first 3 tokens of each assistant turn are not
  trained on; pads with ``<unk>``;
* ``identity``: the contents one after the other; pads with ``<unk>``;
* ``default``: the tokenizer's own ``chat_template`` (tokenizer_config.json), rendered
  with Jinja as Hugging Face transformers renders it; pads with its pad token (else EOS).

Texts are stripped of surrounding whitespace in the nemotron formats. As in Megatron-LM,
the nemotron formats train on the assistant turns only (system, user and tool turns are
masked), while ``identity`` and ``default`` train on every token. The masking tokenizes
each turn alone and requires the pieces to be the conversation's tokens; a conversation
where the tokenizer merges across a turn boundary is an error (``ConversationError``)
naming it, as Megatron-LM's assertion is.

transformers is not needed: the tokenizer is the ``tokenizers`` library's, and the chat
template is rendered by Jinja (which PyTorch installs) in a sandbox with the helpers
transformers gives templates (``raise_exception``, ``tojson``, ``strftime_now``,
``{% generation %}`` blocks, loop controls).
"""

import datetime
import json
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy

from megatron.dataprep.names import SFT_PROMPT_FORMATS as PROMPT_FORMATS
from megatron.dataprep.tokenizer import HuggingFaceTokenizer, TokenizerError

IGNORE_INDEX = -100  # the target of a token the loss does not train on (Megatron-LM's)
ROLES = ("system", "user", "assistant", "tool")


class ConversationError(ValueError):
    """A conversation cannot be tokenized in the chosen prompt format."""


def _nemotron_h_aligned(message) -> str:
    role, content = message["role"], message["content"]
    if role == "system":
        return "<SPECIAL_10>System\n" + content.strip() + "\n"
    if role == "user":
        return "<SPECIAL_11>User\n" + content.strip() + "\n<SPECIAL_11>Assistant\n"
    if role == "assistant":
        return content.strip() + "\n"
    return ""  # the format writes nothing for a tool turn


def _without_thinking_switches(text: str) -> str:
    return text.replace("/think", "").replace("/no_think", "").strip()


def _nemotron_nano_v2(message) -> str:
    role, content = message["role"], message["content"]
    if role == "system":
        return "<SPECIAL_10>System\n" + _without_thinking_switches(content) + "\n"
    if role == "user":
        return "<SPECIAL_11>User\n" + _without_thinking_switches(content) + "\n"
    if role == "assistant":
        return "<SPECIAL_11>Assistant\n" + content.strip() + "\n<SPECIAL_12>\n"
    return ""


def _identity(message) -> str:
    return message["content"]


@dataclass(frozen=True)
class PromptFormat:
    """How one format writes a conversation and which tokens it trains on."""

    render_message: Optional[Callable]  # one message -> text (None: the tokenizer's template)
    pad_token: Optional[str]  # None: the tokenizer's pad token, else its EOS
    assistant_prefix_tokens: int  # tokens at the start of each assistant turn not trained on
    masks_prompts: bool  # system/user/tool turns not trained on


FORMATS = {
    "nemotron-h-aligned": PromptFormat(_nemotron_h_aligned, "<SPECIAL_233>", 0, True),
    "nemotron-nano-v2": PromptFormat(_nemotron_nano_v2, "<unk>", 3, True),
    "identity": PromptFormat(_identity, "<unk>", 0, False),
    "default": PromptFormat(None, None, 0, False),
}


class SFTTokenizer(HuggingFaceTokenizer):
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) with a
    prompt format. Text outside conversations is encoded as HuggingFaceTokenizer does;
    conversations by ``tokenize_conversation``."""

    def __init__(self, tokenizer_model: str, prompt_format: str = "nemotron-h-aligned"):
        if prompt_format not in FORMATS:
            raise TokenizerError(f"--sft-tokenizer-prompt-format: unknown {prompt_format!r}; "
                                 f"choose one of {', '.join(PROMPT_FORMATS)}")
        super().__init__(tokenizer_model)
        self._identity["prompt_format"] = prompt_format
        self.prompt_format = prompt_format
        self._format = FORMATS[prompt_format]
        self._template = None
        if self._format.render_message is None:
            source = _chat_template_of(self.tokenizer_config)
            if source is None:
                raise TokenizerError(
                    f"--sft-tokenizer-prompt-format default uses the tokenizer's chat template, "
                    f"and {os.path.dirname(self.path)}/tokenizer_config.json has no "
                    f"chat_template: add one, or pick another format "
                    f"({', '.join(f for f in PROMPT_FORMATS if f != 'default')})")
            self._template = compile_chat_template(source)
        self._sft_pad = self._pad_id_of_format()

    def _pad_id_of_format(self) -> int:
        token = self._format.pad_token
        if token is None:  # the pad token tokenizer_config.json names, else its EOS
            named = [self._hf.token_to_id(self.special_tokens.get(name) or "")
                     for name in ("pad_token", "eos_token")]
            pad = next((i for i in named if i is not None), None)
            if pad is None:
                raise TokenizerError(
                    f"--sft-tokenizer-prompt-format default pads with the pad_token of "
                    f"tokenizer_config.json, else its eos_token; {self.path} has neither")
            return pad
        pad = self._hf.token_to_id(token)
        if pad is None:
            raise TokenizerError(
                f"--sft-tokenizer-prompt-format {self.prompt_format} pads with {token}, which "
                f"{self.path} does not hold: use the tokenizer this format was made for, or "
                f"--sft-tokenizer-prompt-format default (the tokenizer's own chat template)")
        return pad

    @property
    def pad(self) -> int:
        return self._sft_pad

    def render(self, messages: Sequence[dict]) -> str:
        """The text of ``messages`` in this prompt format (no generation prompt)."""
        if self._template is not None:
            return self._template.render(messages=list(messages), add_generation_prompt=False,
                                         **self.special_tokens)
        return "".join(self._format.render_message(m) for m in messages)

    def _encode(self, text: str) -> numpy.ndarray:
        # as transformers' apply_chat_template: the template writes any special tokens
        return numpy.asarray(self._hf.encode(text, add_special_tokens=False).ids,
                             dtype=numpy.int64)

    def tokenize_conversation(self, conversation: Sequence[dict]
                              ) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """(tokens, targets) of one conversation: targets are the tokens, with
        IGNORE_INDEX where the loss does not train (Megatron-LM's SFTTokenizer)."""
        tokens = self._encode(self.render(conversation))
        targets = tokens.copy()
        if not self._format.masks_prompts:
            return tokens, targets
        at = 0  # (only the built-in formats mask, and none of them writes a BOS)
        for number, turn in enumerate(conversation):
            role = turn["role"]
            piece = self._encode(self.render([turn]))
            if not numpy.array_equal(tokens[at:at + len(piece)], piece):
                raise ConversationError(
                    f"turn {number} ({role}) tokenizes differently alone than inside its "
                    f"conversation (the tokenizer merges across the turn boundary), so its "
                    f"tokens cannot be masked by turn")
            if role == "assistant":
                targets[at:at + self._format.assistant_prefix_tokens] = IGNORE_INDEX
            else:
                targets[at:at + len(piece)] = IGNORE_INDEX
            at += len(piece)
        if at != len(tokens):
            raise ConversationError(f"the turns cover {at} of the conversation's {len(tokens)} "
                                    f"tokens, so they cannot be masked by turn")
        return tokens, targets


def _chat_template_of(config: dict) -> Optional[str]:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def compile_chat_template(source: str):
    """A chat template compiled the way transformers compiles one: a sandboxed Jinja
    environment that trims block lines, with loop controls, ``tojson`` (no ASCII escapes),
    ``raise_exception``, ``strftime_now`` and ``{% generation %}`` blocks (rendered as
    their content)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(line)

        def _content(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise TokenizerError(f"the tokenizer's chat_template is not a valid Jinja template: "
                             f"{error}") from None


def conversations_of(messages: Sequence[dict]) -> List[List[dict]]:
    """The conversations packed in one record's messages: each system message starts a
    new one (Megatron-LM's SFT data convention)."""
    conversations, current = [], []
    for message in messages:
        if message["role"] == "system" and current:
            conversations.append(current)
            current = []
        current.append(message)
    if current:
        conversations.append(current)
    return conversations
