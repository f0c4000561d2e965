"""The fidelity self-check's metrics, floors and verdicts, and its calibration set (workers/fidelity.py,
workers/calibration.py). The self-check on real servers: tests/integration/test_fidelity.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from encoderd.server.models import postprocess
from encoderd.workers import calibration, fidelity
from encoderd.workers.contract.config import BackendOptions, WorkerConfig
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.model_spec import ModelKind, ModelSpec, ScoreActivation
from encoderd.workers.contract.spec_reader import load_model_spec
from encoderd.workers.contract.tokenizer import load_tokenizer


# ------------------------------------------------------------------ metrics
def test_min_cosine_is_scale_free_and_reports_the_worst_row():
    rng = np.random.default_rng(0)
    want = rng.normal(size=(5, 16))
    got = want * np.array([[1.0], [3.0], [0.5], [2.0], [7.0]])  # norms differ, directions equal
    assert fidelity.min_cosine(got, want) == pytest.approx(1.0, abs=1e-12)
    bent = got.copy()
    orthogonal = rng.normal(size=16)
    orthogonal -= orthogonal @ want[3] / (want[3] @ want[3]) * want[3]
    bent[3] = want[3] + orthogonal * np.linalg.norm(want[3]) / np.linalg.norm(orthogonal)  # 45 degrees off
    assert fidelity.min_cosine(bent, want) == pytest.approx(np.sqrt(0.5), abs=1e-9)


@pytest.mark.parametrize("activation", list(ScoreActivation))
def test_scores_are_what_the_frontend_serves(activation):
    """The check's scores are postprocess.scores' for every activation (a CrossEncoder saved with
    Identity is served its logits: the check compared sigmoid probabilities before issue 43)."""
    rng = np.random.default_rng(2)
    for logits in (rng.normal(size=(7, 1)) * 4, rng.normal(size=(7, 3)) * 4, np.array([[1000.0, 0.0, 0.0]])):
        if activation == ScoreActivation.SOFTMAX and logits.shape[1] == 1:
            continue
        served = postprocess.scores(logits.astype(np.float32), activation.value)
        np.testing.assert_allclose(fidelity.served_scores(logits.astype(np.float32), activation), served, rtol=1e-6)


def test_kendall_tau():
    scores = np.arange(10.0)
    assert fidelity.kendall_tau(scores, scores * 2 + 1) == 1.0
    assert fidelity.kendall_tau(scores, -scores) == -1.0
    swapped = scores.copy()
    swapped[[4, 5]] = swapped[[5, 4]]  # one discordant pair of 45
    assert fidelity.kendall_tau(swapped, scores) == pytest.approx(1 - 2 / 45)


def test_top1_agreement():
    want = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    got = want.copy()
    got[2] = [0.9, 0.1]
    assert fidelity.top1_agreement(want, want) == 1.0
    assert fidelity.top1_agreement(got, want) == 0.75


def _spec(kind: ModelKind, **fields) -> ModelSpec:
    return ModelSpec(name="m", path="/nowhere", kind=kind, max_length=16, **fields)


def test_measure_gives_each_kind_its_metrics():
    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(6, 8))
    logits1, logits3 = rng.normal(size=(6, 1)), rng.normal(size=(6, 3))
    assert fidelity.measure(_spec(ModelKind.EMBEDDING), vectors, vectors) == {"min_cosine": pytest.approx(1.0)}
    reranker = fidelity.measure(_spec(ModelKind.RERANKER), logits1 + 0.1, logits1)
    assert set(reranker) == {"max_prob_diff", "kendall_tau"} and reranker["kendall_tau"] == 1.0
    assert reranker["max_prob_diff"] == pytest.approx(0.025)  # a 0.1 logit error at sigmoid's steepest, 1/4
    softmax = _spec(ModelKind.CLASSIFIER, score_activation=ScoreActivation.SOFTMAX)
    classifier = fidelity.measure(softmax, logits3, logits3)
    assert classifier == {"max_prob_diff": 0.0, "top1_agreement": 1.0}


def test_measure_compares_the_served_scores():
    """Fails on the old code: it compared sigmoid probabilities of logits served as they are, and
    softmax probabilities of a multi-label classifier served a sigmoid per label."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(9, 1)) * 5
    off = logits + np.linspace(-0.03, 0.03, 9)[:, None]
    identity = fidelity.measure(_spec(ModelKind.RERANKER, score_activation=ScoreActivation.IDENTITY), off, logits)
    assert identity == {"max_logit_diff": pytest.approx(0.03), "kendall_tau": 1.0}
    labels = rng.normal(size=(9, 3)) * 3
    bent = labels + np.array([0.2, -0.2, 0.0])
    sigmoid = fidelity.measure(_spec(ModelKind.CLASSIFIER, score_activation=ScoreActivation.SIGMOID), bent, labels)
    assert sigmoid["max_prob_diff"] == pytest.approx(0.2 / 4)  # per label: a softmax's would be 0.4 / 4
    at_these_scores = np.max(np.abs(postprocess.sigmoid(bent) - postprocess.sigmoid(labels)))
    assert fidelity.served_difference(bent, labels, ScoreActivation.SIGMOID) == pytest.approx(at_these_scores)


def test_max_prob_diff_bounds_a_logit_error_wherever_the_score_lies():
    """Fails on the old code, which measured the probabilities at the set's own scores: a 0.8 logit
    error at scores near -9 moved them by 0.0002 and passed, yet an input scored near 0 with the same
    error is served 0.2 off (issue 43: a deberta-v2 int8 reranker, 0.011 on the set, 0.124 off it)."""
    tails = np.array([[-9.0], [-8.5], [-10.0]])
    reranker = fidelity.measure(_spec(ModelKind.RERANKER), tails + 0.8, tails)
    assert fidelity.served_difference(tails + 0.8, tails, ScoreActivation.SIGMOID) < 0.001
    assert reranker["max_prob_diff"] == pytest.approx(0.2)
    near_zero = np.array([[-0.4]])
    at_zero = fidelity.served_difference(near_zero + 0.8, near_zero, ScoreActivation.SIGMOID)
    assert at_zero == pytest.approx(0.2, abs=0.003)
    assert not fidelity.judge(reranker, "int8")[0].passed


def test_max_prob_shift_of_a_softmax_is_the_spread_of_the_logit_errors():
    """Adding one number to every label's logit changes no softmax probability; the spread of the
    errors over the labels bounds the change (p_i (1 - p_i) <= 1/4)."""
    logits = np.random.default_rng(4).normal(size=(5, 3)) * 6
    softmax = ScoreActivation.SOFTMAX
    assert fidelity.max_prob_shift(logits + 3.0, logits, softmax) == pytest.approx(0.0)
    bent = logits + np.array([0.3, -0.1, 0.0])
    assert fidelity.max_prob_shift(bent, logits, softmax) == pytest.approx(0.4 / 4)
    assert fidelity.served_difference(bent, logits, softmax) <= 0.1 + 1e-12
    assert fidelity.max_prob_shift(bent, logits, ScoreActivation.SIGMOID) == pytest.approx(0.3 / 4)


def test_min_cosine_is_over_the_served_width():
    """A truncate_dim model is served its first dimensions: the check measures those (without Dense
    modules, whose input the backend's outputs are)."""
    rng = np.random.default_rng(4)
    want = rng.normal(size=(4, 16))
    got = want.copy()
    got[:, 8:] = rng.normal(size=(4, 8))  # the unserved half is noise
    assert fidelity.measure(_spec(ModelKind.EMBEDDING, truncate_dim=8), got, want)["min_cosine"] == pytest.approx(1.0)
    assert fidelity.measure(_spec(ModelKind.EMBEDDING), got, want)["min_cosine"] < 0.9


# ------------------------------------------------------------------- floors
@pytest.mark.parametrize(
    "dtype, row",
    [
        ("float32", "float32"),
        ("float16", "half"),
        ("bfloat16", "half"),
        ("int8", "int8"),
        ("int8_float32", "int8"),
        ("int8_float16", "int8"),
    ],
)
def test_every_dtype_has_a_floor_row(dtype, row):
    assert fidelity.precision(dtype) == row
    metrics = {m for metrics in fidelity.METRICS.values() for m in metrics} | set(fidelity.SCORE_METRICS.values())
    assert set(fidelity.FLOORS[row]) == metrics


def test_floors_are_the_documented_ones_and_tighten_with_precision():
    assert fidelity.FLOORS["float32"]["min_cosine"] == 0.9999
    assert fidelity.FLOORS["half"]["min_cosine"] == 0.999
    assert fidelity.FLOORS["int8"]["min_cosine"] == 0.99
    for metric in fidelity.FLOORS["float32"]:
        ceiling = metric in fidelity.CEILING_METRICS
        f32, half, int8 = (fidelity.FLOORS[row][metric] for row in ("float32", "half", "int8"))
        assert (f32 < half < int8) if ceiling else (f32 > half > int8), metric


def test_judge_applies_floors_and_ceilings_by_dtype():
    [ok] = fidelity.judge({"min_cosine": 0.995}, "int8")
    assert ok.passed and ok.bound == 0.99 and ok.value == 0.995
    [low] = fidelity.judge({"min_cosine": 0.995}, "float32")
    assert not low.passed and low.bound == 0.9999
    assert fidelity.judge({"min_cosine": 0.9999}, "float32")[0].passed  # the floor itself passes
    diff, tau = fidelity.judge({"max_prob_diff": 0.02, "kendall_tau": 0.95}, "bfloat16")
    assert not diff.passed and diff.bound == 0.01  # a ceiling: above it fails
    assert not tau.passed
    diff, tau = fidelity.judge({"max_prob_diff": 0.02, "kendall_tau": 0.95}, "int8")
    assert diff.passed and tau.passed


# ------------------------------------------------------------- calibration
@pytest.fixture(scope="module")
def minilm_spec():
    return load_model_spec("minilm", default_model_path())


def test_calibration_batches_reach_the_maximum_length_and_mix_lengths(minilm_spec):
    batches = calibration.batches(minilm_spec)
    lengths = np.concatenate([b.lengths for b in batches])
    assert all(b.size <= calibration.BATCH_SIZE for b in batches)
    assert lengths.max() == minilm_spec.max_length  # long passages, cut
    # the two long passages, and the repeated dashes, words and "=" rules (each over 256 tokens)
    assert (lengths == minilm_spec.max_length).sum() == 2 + 3
    assert lengths.min() <= 8  # short queries
    assert sum(len(set(b.lengths.tolist())) > 1 for b in batches) >= len(batches) - 1  # padding exercised
    assert all(b.token_type_ids is None for b in batches)
    assert len(calibration.batches(minilm_spec, batch_size=3)[0].lengths) == 3


def test_calibration_covers_every_length_band_and_whitespace_wrapped_punctuation(minilm_spec, reranker_path):
    """Issue 43 item 3 (VERSION 4): texts in every band from a few tokens to the maximum, tokens that
    are nearly all special around whitespace, and near-tie pairs for rerankers."""
    lengths = np.concatenate([b.lengths for b in calibration.batches(minilm_spec)])
    top = minilm_spec.max_length
    for low, high in [(1, 8), (9, 32), (33, top // 4), (top // 4 + 1, top // 2), (top // 2 + 1, top - 1), (top, top)]:
        assert ((lengths >= low) & (lengths <= high)).any(), (low, high)
    texts = calibration.texts(load_tokenizer(minilm_spec.path), top)
    assert "  .  " in texts and any(t.strip() == "word" and t != "word" for t in texts)
    spec = load_model_spec("reranker", reranker_path)
    pairs = calibration.pairs(load_tokenizer(spec.path), spec.max_length)
    for query, first, second in calibration.NEAR_TIES:
        assert (query, first) in pairs and (query, second) in pairs


def test_calibration_texts_cover_scripts_code_and_emoji(minilm_spec):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{minilm_spec.path}/tokenizer.json")
    texts = calibration.texts(tokenizer, minilm_spec.max_length)
    joined = "".join(texts)
    for first, last in [
        (0x4E00, 0x9FFF),
        (0x0600, 0x06FF),
        (0x0400, 0x04FF),
        (0x0900, 0x097F),
        (0x0370, 0x03FF),
        (0xAC00, 0xD7AF),
        (0x0E00, 0x0E7F),
        (0x1F300, 0x1FAFF),
    ]:
        assert any(first <= ord(c) <= last for c in joined), hex(first)
    assert any("def " in t for t in texts) and any("SELECT" in t for t in texts)


def test_reranker_calibration_is_pairs_with_token_types(reranker_path):
    spec = load_model_spec("reranker", reranker_path)
    batches = calibration.batches(spec)
    assert sum(b.size for b in batches) == len(calibration.PAIR_QUERIES) * 6 + 2 + 2 * len(calibration.NEAR_TIES) + 14
    assert all(b.token_type_ids is not None and b.token_type_ids.max() == 1 for b in batches)
    assert max(int(b.lengths.max()) for b in batches) == spec.max_length


# ------------------------------------------------------------------ verdict
class _Backend:
    """Serves the reference, bent by `noise` (relative, per row)."""

    engine = "fake"

    def __init__(self, want: np.ndarray, noise: float, dtype: str):
        self.want, self.noise, self.row = want, noise, 0
        self.options = BackendOptions(dtype=dtype)

    def forward(self, batch):
        rows = self.want[self.row : self.row + batch.size]
        self.row += batch.size
        bend = np.random.default_rng(self.row).normal(size=rows.shape) * np.linalg.norm(rows, axis=1, keepdims=True)
        return (rows + self.noise * bend / np.sqrt(rows.shape[1])).astype(np.float32)


@pytest.fixture
def fake_reference(monkeypatch, minilm_spec):
    n = sum(b.size for b in calibration.batches(minilm_spec))
    want = np.random.default_rng(2).normal(size=(n, 384)).astype(np.float32)
    monkeypatch.setattr(fidelity, "reference", lambda spec, batches, cache_dir, trust_remote_code=False: (want, True))
    return want


def test_self_check_passes_a_faithful_backend(fake_reference, minilm_spec):
    report = fidelity.self_check(_Backend(fake_reference, 0.0, "float32"), minilm_spec, allow_low=False)
    assert report.status == fidelity.PASSED and report.inputs == len(fake_reference)
    assert [f.metric for f in report.figures] == ["min_cosine"] and report.figures[0].value == pytest.approx(1.0)
    assert report.tokens_per_s > 0  # its speed on the calibration batches: admission's first estimate


def test_self_check_refuses_below_the_floor_with_one_clear_line(fake_reference, minilm_spec, caplog):
    backend = _Backend(fake_reference, 0.3, "int8")  # cosine ~0.96: below int8's 0.99
    with caplog.at_level(logging.INFO, "encoderd.fidelity"), pytest.raises(fidelity.LowFidelity) as refused:
        fidelity.self_check(backend, minilm_spec, allow_low=False)
    [line] = [r for r in caplog.records if r.levelno == logging.ERROR]
    text = line.getMessage()
    assert "\n" not in text
    assert "minilm (fake int8 on cpu)" in text and "min_cosine 0.9" in text and "(floor 0.99)" in text
    assert "--dtype float32" in text and "--allow-low-fidelity" in text
    assert "min_cosine" in str(refused.value)


def test_self_check_serves_low_fidelity_when_allowed(fake_reference, minilm_spec, caplog):
    with caplog.at_level(logging.WARNING, "encoderd.fidelity"):
        report = fidelity.self_check(_Backend(fake_reference, 0.3, "int8"), minilm_spec, allow_low=True)
    assert report.status == fidelity.LOW
    [figure] = report.figures
    assert 0.9 < figure.value < 0.99 and not figure.passed
    assert any(r.levelno == logging.WARNING and "serving it anyway" in r.getMessage() for r in caplog.records)


def test_an_automatic_dtype_below_the_floor_falls_back_to_float32(fake_reference, minilm_spec, monkeypatch, caplog):
    """Issue 19.1: bfloat16 that the server chose itself (--dtype auto) and that fails the check is
    replaced by float32 with a WARNING; the same dtype named by the operator is refused (above)."""
    import msgspec

    from encoderd.workers import process

    class Loadable(_Backend):
        def load(self):
            pass

        def warmup(self, max_length):
            pass

    built = []

    def create_backend(engine, spec, options):
        dtype = "bfloat16" if options.dtype == "auto" else options.dtype
        built.append(Loadable(fake_reference, 0.3 if dtype == "bfloat16" else 0.0, dtype))
        return built[-1]

    monkeypatch.setattr(process, "create_backend", create_backend)
    config = WorkerConfig(minilm_spec, "torch", BackendOptions(dtype="auto"), "ipc://a", "ipc://b")
    with caplog.at_level(logging.INFO, "encoderd.fidelity"):
        backend, report = process._load(config)
    assert [b.options.dtype for b in built] == ["bfloat16", "float32"] and backend is built[-1]
    assert report.status == fidelity.PASSED
    assert any(r.levelno == logging.WARNING and "falls back to float32" in r.getMessage() for r in caplog.records)
    with pytest.raises(fidelity.LowFidelity):  # named by the operator: refused, no fallback
        process._load(msgspec.structs.replace(config, options=BackendOptions(dtype="bfloat16")))


def test_kinds_outside_the_calibration_set_are_reported_unchecked(minilm_spec):
    import msgspec

    clip = msgspec.structs.replace(minilm_spec, kind=ModelKind.CLIP)
    report = fidelity.self_check(_Backend(np.zeros((1, 1)), 0.0, "float32"), clip, allow_low=False)
    assert report.status == fidelity.UNCHECKED and report.figures == ()


@pytest.mark.parametrize("kind", [ModelKind.CLIP, ModelKind.SPARSE])
@pytest.mark.parametrize("auto_pick", ["bfloat16", "int8", "float16"])
def test_auto_keeps_float32_where_the_check_cannot_measure(monkeypatch, minilm_spec, kind, auto_pick):
    """An automatic lower precision is served only where the self-check measures it (bfloat16 moved a
    SPLADE model's top terms); the operator's explicit --dtype is served as asked."""
    import msgspec

    from encoderd.workers import backends

    monkeypatch.setattr(backends, "resolve_options", lambda o, e="auto": msgspec.structs.replace(o, dtype=auto_pick))
    monkeypatch.setattr(backends.hardware, "check_dtype", lambda *args: None)
    spec = msgspec.structs.replace(minilm_spec, kind=kind)
    assert backends.create_backend("torch", spec, BackendOptions(dtype="auto")).options.dtype == "float32"
    text = backends.create_backend("torch", minilm_spec, BackendOptions(dtype="auto"))
    assert text.options.dtype == auto_pick


# --------------------------------------------------------------------- flag
@pytest.mark.parametrize(
    "argv, env, allowed",
    [([], {}, False), (["--allow-low-fidelity"], {}, True), ([], {"ENCODERD_ALLOW_LOW_FIDELITY": "1"}, True)],
)
def test_allow_low_fidelity_flag_and_env(monkeypatch, argv, env, allowed):
    from encoderd.server.main.configure import config_from_args
    from encoderd.server.main.flags import build_parser

    monkeypatch.delenv("ENCODERD_ALLOW_LOW_FIDELITY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = config_from_args(build_parser().parse_args(["serve", *argv]))
    assert config.allow_low_fidelity is allowed
