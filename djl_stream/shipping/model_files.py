"""What an older transformers reads of a model directory that a newer one wrote.

A model directory saved with transformers 5 (what ``pip install djl-stream`` gets locally)
runs inside the djl-serving images under their own, older transformers: 4.51.3 on LMI,
4.45.2 on Neuron (see :mod:`djl_stream.shipping.images`). Some of what 5.x writes those releases
cannot read, and they say nothing about it. Each fact below was read in the releases' own
sources (the wheels of 4.45.2, 4.46.0, 4.47.0, 4.51.3, 4.56.2, 4.57.1 and 5.0.0):

- ``config.json`` with ``rope_parameters`` and no ``rope_theta``: 5.0.0 is the first release
  whose configs take ``rope_parameters`` (``models/llama/configuration_llama.py``); up to
  4.57.1 ``LlamaConfig`` reads ``rope_theta`` (default 10000.0) and ``rope_scaling``, and
  keeps an unknown key as a plain attribute. An older release therefore runs the model with
  the default theta: no error, different numbers (SmolLM2 was trained with 100000).
  transformers-neuronx reads ``config.rope_theta`` too.
- ``tokenizer_config.json`` naming a ``tokenizer_class`` the release lacks:
  ``AutoTokenizer`` tries ``XFast``, then ``X``, and raises ``ValueError: Tokenizer class X
  does not exist or is not currently imported.`` (``models/auto/tokenization_auto.py``). 5.x writes
  ``TokenizersBackend`` (``tokenization_utils_tokenizers.py``, new in 5.0.0, absent from
  4.57.1) for many models. :data:`TOKENIZER_CLASSES` holds the names each image's release
  resolves.
- a chat template only in ``chat_template.jinja``: ``tokenization_utils_base.py`` reads that
  file (``CHAT_TEMPLATE_FILE``) from 4.47.0 on; 4.45.2 and 4.46.0 read the template only from
  ``tokenizer_config.json``'s ``chat_template``, so the tokenizer has none there.

>>> problems = model_file_problems_of({"rope_parameters": {"rope_theta": 1e5}}, {}, False,
...                                   "4.51.3")
>>> [p.file for p in problems]
['config.json']
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Optional

from packaging.version import Version

#: First release whose configs read ``rope_parameters`` (earlier: ``rope_theta``).
ROPE_PARAMETERS_SINCE = Version("5.0.0")
#: First release that reads a chat template from ``chat_template.jinja``.
CHAT_TEMPLATE_FILE_SINCE = Version("4.47.0")
#: The class 5.x writes into tokenizer_config.json, first in 5.0.0.
TOKENIZERS_BACKEND = "TokenizersBackend"

# The tokenizer class names transformers/__init__.py exports in each release: what
# tokenizer_class_from_name() resolves (the auto mapping's names are all among them).
_TOKENIZERS_4_45_2 = frozenset("""
    AlbertTokenizer AlbertTokenizerFast AutoTokenizer BartTokenizer BartTokenizerFast
    BarthezTokenizer BarthezTokenizerFast BartphoTokenizer BasicTokenizer
    BertGenerationTokenizer BertJapaneseTokenizer BertTokenizer BertTokenizerFast
    BertweetTokenizer BigBirdTokenizer BigBirdTokenizerFast BioGptTokenizer
    BlenderbotSmallTokenizer BlenderbotSmallTokenizerFast BlenderbotTokenizer
    BlenderbotTokenizerFast BloomTokenizerFast ByT5Tokenizer CLIPTokenizer CLIPTokenizerFast
    CTRLTokenizer CamembertTokenizer CamembertTokenizerFast CanineTokenizer
    CharacterTokenizer ClvpTokenizer CodeGenTokenizer CodeGenTokenizerFast
    CodeLlamaTokenizer CodeLlamaTokenizerFast CohereTokenizerFast ConvBertTokenizer
    ConvBertTokenizerFast CpmAntTokenizer CpmTokenizer CpmTokenizerFast
    DPRContextEncoderTokenizer DPRContextEncoderTokenizerFast DPRQuestionEncoderTokenizer
    DPRQuestionEncoderTokenizerFast DPRReaderTokenizer DPRReaderTokenizerFast
    DebertaTokenizer DebertaTokenizerFast DebertaV2Tokenizer DebertaV2TokenizerFast
    DistilBertTokenizer DistilBertTokenizerFast ElectraTokenizer ElectraTokenizerFast
    ErnieMTokenizer EsmTokenizer FNetTokenizer FNetTokenizerFast FSMTTokenizer
    FastSpeech2ConformerTokenizer FlaubertTokenizer FunnelTokenizer FunnelTokenizerFast
    GPT2Tokenizer GPT2TokenizerFast GPTNeoXJapaneseTokenizer GPTNeoXTokenizerFast
    GPTSanJapaneseTokenizer GPTSw3Tokenizer GemmaTokenizer GemmaTokenizerFast
    HerbertTokenizer HerbertTokenizerFast JukeboxTokenizer LEDTokenizer LEDTokenizerFast
    LayoutLMTokenizer LayoutLMTokenizerFast LayoutLMv2Tokenizer LayoutLMv2TokenizerFast
    LayoutLMv3Tokenizer LayoutLMv3TokenizerFast LayoutXLMTokenizer LayoutXLMTokenizerFast
    LlamaTokenizer LlamaTokenizerFast LongformerTokenizer LongformerTokenizerFast
    LukeTokenizer LxmertTokenizer LxmertTokenizerFast M2M100Tokenizer MBart50Tokenizer
    MBart50TokenizerFast MBartTokenizer MBartTokenizerFast MLukeTokenizer MPNetTokenizer
    MPNetTokenizerFast MT5Tokenizer MT5TokenizerFast MarianTokenizer MarkupLMTokenizer
    MarkupLMTokenizerFast MecabTokenizer MgpstrTokenizer MobileBertTokenizer
    MobileBertTokenizerFast MvpTokenizer MvpTokenizerFast NllbTokenizer NllbTokenizerFast
    NougatTokenizerFast OpenAIGPTTokenizer OpenAIGPTTokenizerFast PLBartTokenizer
    PegasusTokenizer PegasusTokenizerFast PerceiverTokenizer PhobertTokenizer
    Pop2PianoTokenizer PreTrainedTokenizer PreTrainedTokenizerFast ProphetNetTokenizer
    Qwen2Tokenizer Qwen2TokenizerFast RagTokenizer RealmTokenizer RealmTokenizerFast
    ReformerTokenizer ReformerTokenizerFast RemBertTokenizer RemBertTokenizerFast
    RetriBertTokenizer RetriBertTokenizerFast RoCBertTokenizer RoFormerTokenizer
    RoFormerTokenizerFast RobertaTokenizer RobertaTokenizerFast SeamlessM4TTokenizer
    SeamlessM4TTokenizerFast SiglipTokenizer Speech2Text2Tokenizer Speech2TextTokenizer
    SpeechT5Tokenizer SplinterTokenizer SplinterTokenizerFast SqueezeBertTokenizer
    SqueezeBertTokenizerFast T5Tokenizer T5TokenizerFast TFBertTokenizer TFGPT2Tokenizer
    TapasTokenizer TapexTokenizer TransfoXLTokenizer UdopTokenizer UdopTokenizerFast
    VitsTokenizer Wav2Vec2CTCTokenizer Wav2Vec2PhonemeCTCTokenizer Wav2Vec2Tokenizer
    WhisperTokenizer WhisperTokenizerFast WordpieceTokenizer XGLMTokenizer XGLMTokenizerFast
    XLMProphetNetTokenizer XLMRobertaTokenizer XLMRobertaTokenizerFast XLMTokenizer
    XLNetTokenizer XLNetTokenizerFast
""".split())

#: Tokenizer class names each image's transformers resolves, by release.
TOKENIZER_CLASSES: Mapping[str, frozenset] = {
    "4.45.2": _TOKENIZERS_4_45_2,
    "4.51.3": _TOKENIZERS_4_45_2 | {"MyT5Tokenizer"},
}


@dataclasses.dataclass(frozen=True)
class ModelFileProblem:
    """One thing a transformers release cannot read correctly in a model directory:
    the ``file``, what goes wrong (``message``) and what to write instead (``fix``)."""

    file: str
    message: str
    fix: str


def _read_json(path: Path) -> Mapping[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def model_file_problems(directory: Path, transformers: str) -> list[ModelFileProblem]:
    """What transformers ``transformers`` (a version) cannot read correctly in the Hugging
    Face folder ``directory``; empty when nothing is known to be wrong."""
    return model_file_problems_of(_read_json(directory / "config.json"),
                                  _read_json(directory / "tokenizer_config.json"),
                                  (directory / "chat_template.jinja").is_file(), transformers)


def model_file_problems_of(config: Mapping[str, Any], tokenizer_config: Mapping[str, Any],
                           has_chat_template_file: bool,
                           transformers: str) -> list[ModelFileProblem]:
    """:func:`model_file_problems` on the parsed files."""
    version = Version(transformers)
    problems = []
    rope = _rope_problem(config, version)
    if rope:
        problems.append(rope)
    tokenizer = _tokenizer_class_problem(tokenizer_config, transformers)
    if tokenizer:
        problems.append(tokenizer)
    if (has_chat_template_file and not tokenizer_config.get("chat_template")
            and version < CHAT_TEMPLATE_FILE_SINCE):
        problems.append(ModelFileProblem(
            "chat_template.jinja",
            f"the chat template is only in chat_template.jinja, which transformers "
            f"{transformers} does not read (it does from {CHAT_TEMPLATE_FILE_SINCE}): the "
            "tokenizer has no chat template there, so messages requests fail and "
            "option.apply_chat_template=auto sends prompts without it",
            "copy the template into tokenizer_config.json as \"chat_template\"",
        ))
    return problems


def _rope_problem(config: Mapping[str, Any], version: Version) -> Optional[ModelFileProblem]:
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in config or version >= ROPE_PARAMETERS_SINCE:
        return None
    theta = rope.get("rope_theta")
    default = " (10000.0 for Llama)" if config.get("model_type") == "llama" else ""
    fix = (f"add \"rope_theta\": {theta} to config.json" if theta is not None
           else "add the top-level \"rope_theta\" (and \"rope_scaling\") transformers 4 reads")
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default" and "rope_scaling" not in config:
        fix += f", and \"rope_scaling\" for rope_type {rope_type!r}"
    return ModelFileProblem(
        "config.json",
        f"rope_parameters without rope_theta: transformers {version} reads only rope_theta "
        f"(rope_parameters arrived in {ROPE_PARAMETERS_SINCE}) and silently runs the model "
        f"with its default theta{default}" + (f" instead of {theta}" if theta is not None else "")
        + ": no error, wrong output",
        fix,
    )


def _tokenizer_class_problem(tokenizer_config: Mapping[str, Any],
                             transformers: str) -> Optional[ModelFileProblem]:
    name = tokenizer_config.get("tokenizer_class")
    known = TOKENIZER_CLASSES.get(transformers)
    if not isinstance(name, str) or known is None:
        return None
    # AutoTokenizer tries NameFast first (use_fast), then Name.
    candidates = {name, name if name.endswith("Fast") else f"{name}Fast"}
    if candidates & known:
        return None
    new = " (new in 5.0.0)" if name == TOKENIZERS_BACKEND else ""
    return ModelFileProblem(
        "tokenizer_config.json",
        f"tokenizer_class {name}{new} does not exist in transformers {transformers}: "
        f"AutoTokenizer fails the load (\"Tokenizer class {name} does not exist or is not "
        "currently imported.\")",
        "set \"tokenizer_class\" to the class of the model's original tokenizer (e.g. "
        "GPT2Tokenizer for SmolLM2), or PreTrainedTokenizerFast, which reads any "
        "tokenizer.json",
    )
