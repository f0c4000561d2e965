"""What a served model is: its kind, pooling, post-processing modules and the settings both
processes need (ModelSpec), and the error a model that cannot be served raises.

Only the types and the rules that read a spec live here; reading them from a model's files is
spec_reader.py (config.json and the model as a whole), st_pipeline.py (modules.json and each module's
config) and st_config.py (sentence-transformers' other settings files); where the files are is
model_files.py. Everything above imports this module, and it imports none of them.
"""

from __future__ import annotations

import enum

import msgspec


class ModelKind(str, enum.Enum):
    EMBEDDING = "embedding"
    RERANKER = "reranker"  # a cross-encoder with one output
    CLASSIFIER = "classifier"  # a sequence classifier over id2label
    CLIP = "clip"  # image-text dual encoder (CLIPModel): texts and images in one space
    CLAP = "clap"  # audio-text dual encoder (ClapModel): texts and audio in one space
    COLBERT = "colbert"  # late interaction over text: one unit vector per token
    # Late interaction over document pages and queries: ColPaliForRetrieval (PaliGemma) and
    # ColQwen2ForRetrieval (Qwen2-VL), one 128-d unit vector per image / query token, with their processors.
    COLPALI = "colpali"
    # Late interaction on a CLIP model: one unit vector per image patch / text token in the joint space
    # (what `colpali` named before real ColPali checkpoints were served).
    CLIP_PATCHES = "clip_patches"
    SPARSE = "sparse"  # SPLADE over a masked-LM head: a sparse vocabulary-sized vector

    @property
    def a_model(self) -> str:
        """The kind in a sentence, with its article: "an embedding model", "a reranker model"."""
        return f"{indefinite_article(self.value)} {self.value} model"


def indefinite_article(word: str) -> str:
    """ "an" before a vowel, else "a" (every kind name: embedding, clap, colbert, ...)."""
    return "an" if word and word[0].lower() in "aeiou" else "a"


# What each kind takes. Text is every kind's; the media modalities need their tower.
MODALITIES = {
    ModelKind.CLIP: ("text", "image"),
    ModelKind.CLAP: ("text", "audio"),
    ModelKind.COLPALI: ("text", "image"),
    ModelKind.CLIP_PATCHES: ("text", "image"),
}
MULTI_VECTOR_KINDS = (ModelKind.COLBERT, ModelKind.COLPALI, ModelKind.CLIP_PATCHES)
# Kinds whose embeddings are projected into a space shared with another modality.
DUAL_ENCODER_KINDS = (ModelKind.CLIP, ModelKind.CLAP, ModelKind.CLIP_PATCHES)
# The transformers classes the colpali kind serves, by config.json model_type.
RETRIEVAL_CLASSES = {"colpali": "ColPaliForRetrieval", "colqwen2": "ColQwen2ForRetrieval"}


def modalities(kind: ModelKind) -> tuple[str, ...]:
    return MODALITIES.get(kind, ("text",))


class Pooling(str, enum.Enum):
    """sentence-transformers' pooling modes, named as its current `pooling_mode` config key names them."""

    MEAN = "mean"
    CLS = "cls"
    MAX = "max"
    LAST_TOKEN = "lasttoken"
    WEIGHTED_MEAN = "weightedmean"  # weights 1, 2, 3... by position
    MEAN_SQRT_LEN = "mean_sqrt_len_tokens"  # sum / sqrt(tokens)


def pooling_modes(pooling: Pooling | tuple[Pooling, ...]) -> tuple[Pooling, ...]:
    """One mode or several (concatenated in this order, as sentence-transformers does)."""
    return (pooling,) if isinstance(pooling, Pooling) else tuple(pooling)


class ScoreActivation(str, enum.Enum):
    """What turns a reranker's or classifier's logits into scores."""

    SOFTMAX = "softmax"  # single-label classification: one distribution over the labels
    SIGMOID = "sigmoid"  # multi-label classification (each label alone), and one-label cross-encoders
    IDENTITY = "identity"  # regression, or a cross-encoder whose config says Identity: the logits as they are


class DenseModule(msgspec.Struct, frozen=True):
    """A sentence-transformers Dense module: activation(x @ W.T + b) (+ a residual), after pooling."""

    path: str  # its directory: config.json and model.safetensors / pytorch_model.bin
    in_features: int
    out_features: int
    activation: str  # a torch.nn class name from DENSE_ACTIVATIONS
    bias: bool = True
    residual: bool = False  # use_residual: + x (or + x @ R.T when the widths differ)
    normalize_input: bool = False  # a Normalize module sits right before this one


# Activations a Dense module may name (as `torch.nn.modules.activation.Tanh` and the like); all take
# no arguments, which is how sentence-transformers builds them from the config.
DENSE_ACTIVATIONS = (
    "Identity",
    "Tanh",
    "Sigmoid",
    "ReLU",
    "GELU",
    "SiLU",
    "LeakyReLU",
    "ELU",
    "Softplus",
    "Mish",
    "Hardtanh",
    "Softsign",
)


class ModelSpec(msgspec.Struct, frozen=True):
    """Everything both processes need to know about one served model."""

    name: str
    path: str
    kind: ModelKind
    max_length: int
    pooling: tuple[Pooling, ...] = (Pooling.MEAN,)  # several: concatenated (see pooling_modes)
    normalize: bool = False  # L2 at the end (the frontend does it, after the worker's Dense modules)
    labels: tuple[str, ...] = ()
    hidden_size: int = 0
    prompts: dict[str, str] = {}  # sentence-transformers named prompts
    default_prompt_name: str | None = None
    include_prompt: bool = True  # False: pooling must skip the prompt's tokens; served without prompts only
    dense: tuple[DenseModule, ...] = ()  # applied in the worker after pooling (workers/st_modules.py)
    lowercase: bool = False  # sentence-transformers' do_lower_case: texts lower-cased before tokenizing
    score_activation: ScoreActivation = ScoreActivation.SIGMOID  # rerankers and classifiers
    model_type: str = ""  # config.json's: the family engines claim or refuse (bert, qwen3, ...)
    pad_token_id: int = 0  # what padded engines fill with: decoder classifiers score the last non-pad token
    # config_sentence_transformers.json's truncate_dim (0: none): the served width, cut after the
    # model's normalization and not re-normalized, as sentence-transformers does (server/models/postprocess.py)
    truncate_dim: int = 0

    def served_width(self, computed: int) -> int:
        """The width requests get from `computed` (the worker's output width)."""
        return min(computed, self.truncate_dim) if self.truncate_dim else computed


class ModelLoadError(Exception):
    """The model cannot be found or understood; the message says why."""


def check_prompts(spec: ModelSpec, prompts: dict[str, str]) -> None:
    """A model whose pooling excludes the prompt (include_prompt false) is served without prompts:
    encoderd pools over every token, so a prompted vector would differ from sentence-transformers'."""
    used = sorted(name for name, text in prompts.items() if text)
    if used and not spec.include_prompt and spec.kind == ModelKind.EMBEDDING:
        raise ModelLoadError(
            f"{spec.name}: its Pooling module excludes prompt tokens (include_prompt: false), which "
            f"encoderd does not compute, and prompts are configured ({', '.join(used)}); serve it "
            f"without prompts"
        )
