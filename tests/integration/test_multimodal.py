"""Issue 8: multi-modal (CLIP images, CLAP audio), multi-vector (ColBERT, per-patch CLIP: clip_patches)
and sparse (SPLADE) models, served by one real server with real workers and Envoy, and
compared with a direct transformers forward on the same tiny models and inputs."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
import time
from typing import ClassVar

import grpc
import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.media import encoded, random_image
from support.multimodal_models import CLAP_SAMPLING_RATE, build_clap, build_clip, build_colbert, build_sparse
from support.server import ServerProcess, free_port

from encoderd.v1 import encoderd_pb2 as pb

pytest.importorskip("PIL")
pytest.importorskip("soundfile")

MAX_MEDIA_BYTES = 256 * 1024  # --media-max-mb 0.25
FETCH_TIMEOUT = 1.5  # --media-fetch-timeout
TOL = 1e-4
CLIP_TEXTS = ["a photo of a cat", "the red car", "a dog with a blue chart"]
COLBERT_DOCS = ["search engines rank documents", "a cat sat on the mat", "late interaction models score tokens"]


# ------------------------------------------------------------------ inputs
def tone(freq: float, seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * np.random.default_rng(int(freq)).standard_normal(len(t))
    return np.stack([wave * (c + 1) / channels for c in range(channels)], axis=1).astype(np.float32)


def sound_file(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype="FLOAT" if fmt == "WAV" else "PCM_24")
    return buf.getvalue()


IMAGES = [random_image(1), random_image(2, (40, 80)), random_image(3, (33, 33))]
PNG = encoded(IMAGES[0])
WAV = sound_file(tone(440, 0.5, CLAP_SAMPLING_RATE), CLAP_SAMPLING_RATE, "WAV")
# A float WAV may hold any finite value: five samples, the last 1.5e37, overflowed CLAP's features
# into NaN, and the server answered a NaN embedding (found by the fuzz test below).
LOUD_WAV = sound_file(np.array([[-0.05], [0.03], [0.18], [0.18], [1.5e37]], np.float32), CLAP_SAMPLING_RATE, "WAV")
STEREO_WAV = sound_file(tone(660, 0.7, CLAP_SAMPLING_RATE, channels=2), CLAP_SAMPLING_RATE, "WAV")
FLAC_8K = sound_file(tone(300, 0.6, 8000), 8000, "FLAC")  # resampled to 16 kHz by the server


def image_content(data: bytes) -> pb.Content:
    return pb.Content(image=pb.Media(data=data))


def vectors(embeddings) -> np.ndarray:
    return np.array([e.values for e in embeddings], dtype=np.float32)


def unit(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


# ------------------------------------------------------------- a media site
class _Site(http.server.BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}  # shared by every handler instance

    def do_GET(self):
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the server under test gave up on us
            self._answer()

    def _answer(self):
        if self.path == "/slow":  # answers nothing before the fetch timeout has passed
            time.sleep(FETCH_TIMEOUT + 1.5)
            return
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        if self.path == "/trickle":  # no Content-Length, more than the limit, slowly enough to notice
            self.send_response(200)
            self.end_headers()
            for _ in range(MAX_MEDIA_BYTES // 16384 + 2):
                self.wfile.write(b"\0" * 16384)
            return
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site():
    """A loopback HTTP server holding the test media (the only URLs the tests fetch)."""
    _Site.files = {"/cat.png": PNG, "/tone.wav": WAV, "/big.png": b"\x89PNG" + b"\0" * MAX_MEDIA_BYTES}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Site)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


# ------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def paths(models_dir):
    return {
        "clip": build_clip(models_dir / "mm-clip"),
        "clap": build_clap(models_dir / "mm-clap"),
        "colbert": build_colbert(models_dir / "mm-colbert"),
        "sparse": build_sparse(models_dir / "mm-sparse"),
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory, paths):
    """The server starts now; the references below are computed while its workers load."""
    log = tmp_path_factory.mktemp("multimodal") / "server.log"
    proc = ServerProcess(
        "--model",
        f"clip={paths['clip']}",
        "--model",
        f"clap={paths['clap']}",
        "--model",
        f"colbert={paths['colbert']}",
        "--model",
        f"clip_patches={paths['clip']}:clip_patches",
        "--model",
        f"splade={paths['sparse']}:sparse",
        "--cpu-threads",
        "1",
        "--media-max-mb",
        str(MAX_MEDIA_BYTES / 2**20),
        "--media-fetch-timeout",
        str(FETCH_TIMEOUT),
        rest=True,
        log_path=log,
    )
    proc.launch()
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def server(launched, refs):
    launched.wait_serving(240)
    launched.wait_rest(60)
    return launched


@pytest.fixture(scope="module")
def stub(server):
    return server.stub()


@pytest.fixture(scope="module")
def rest(server):
    with httpx.Client(base_url=server.rest_url, timeout=60) as client:
        yield client


# -------------------------------------------------------------- references
class References:
    """Direct transformers forwards on the same directories and inputs."""

    def __init__(self, paths):
        from transformers import (
            AutoTokenizer,
            BertForMaskedLM,
            BertModel,
            ClapFeatureExtractor,
            ClapModel,
            CLIPModel,
            CLIPProcessor,
        )

        torch.set_num_threads(1)
        self.clip = CLIPModel.from_pretrained(paths["clip"]).eval()
        self.clip_processor = CLIPProcessor.from_pretrained(paths["clip"])
        self.clap = ClapModel.from_pretrained(paths["clap"]).eval()
        self.clap_features = ClapFeatureExtractor.from_pretrained(paths["clap"])
        self.clap_tokenizer = AutoTokenizer.from_pretrained(paths["clap"])
        self.bert_tokenizer = AutoTokenizer.from_pretrained(paths["colbert"])
        self.colbert = BertModel.from_pretrained(paths["colbert"]).eval()
        from safetensors.torch import load_file

        self.colbert_proj = load_file(str(paths["colbert"] / "1_Dense" / "model.safetensors"))["linear.weight"]
        self.mlm = BertForMaskedLM.from_pretrained(paths["sparse"]).eval()

    # clip
    @torch.no_grad()
    def clip_text(self, texts) -> tuple[np.ndarray, list[np.ndarray]]:
        """Text embeddings, and per text its token vectors in the joint space (ColPali-style)."""
        tok = self.clip_processor.tokenizer(texts, padding=True, return_tensors="pt")
        out = self.clip.get_text_features(input_ids=tok.input_ids, attention_mask=tok.attention_mask)
        tokens = self.clip.text_projection(out.last_hidden_state).numpy()
        mask = tok.attention_mask.bool().numpy()
        return out.pooler_output.numpy(), [unit(t[m]) for t, m in zip(tokens, mask, strict=True)]

    @torch.no_grad()
    def clip_images(self, images) -> tuple[np.ndarray, list[np.ndarray]]:
        pixels = self.clip_processor(images=images, return_tensors="pt")["pixel_values"]
        out = self.clip.get_image_features(pixel_values=pixels)
        patches = self.clip.visual_projection(self.clip.vision_model.post_layernorm(out.last_hidden_state)).numpy()
        return out.pooler_output.numpy(), [unit(p) for p in patches]

    # clap
    @torch.no_grad()
    def clap_audio(self, waves) -> np.ndarray:
        rows = []
        for wave in waves:  # one clip per extractor call, as the server does (fusion flags are per call)
            f = self.clap_features(wave, sampling_rate=CLAP_SAMPLING_RATE, return_tensors="pt")
            rows.append(
                self.clap.get_audio_features(input_features=f["input_features"], is_longer=f["is_longer"])
                .pooler_output[0]
                .numpy()
            )
        return np.stack(rows)

    @torch.no_grad()
    def clap_text(self, texts) -> np.ndarray:
        tok = self.clap_tokenizer(texts, padding=True, return_tensors="pt")
        return self.clap.get_text_features(
            input_ids=tok.input_ids, attention_mask=tok.attention_mask
        ).pooler_output.numpy()

    # colbert / splade
    @torch.no_grad()
    def colbert_tokens(self, texts) -> list[np.ndarray]:
        tok = self.bert_tokenizer(texts, padding=True, return_tensors="pt")
        hidden = self.colbert(**tok).last_hidden_state @ self.colbert_proj.T
        return [unit(h[m]) for h, m in zip(hidden.numpy(), tok.attention_mask.bool().numpy(), strict=True)]

    @torch.no_grad()
    def splade(self, texts) -> np.ndarray:
        tok = self.bert_tokenizer(texts, padding=True, return_tensors="pt")
        logits = self.mlm(**tok).logits.numpy().astype(np.float64)
        weights = np.log1p(np.maximum(logits, 0)) * tok.attention_mask.numpy()[:, :, None]
        return weights.max(axis=1)


@pytest.fixture(scope="module")
def refs(launched, paths):
    return References(paths)


def decode_wave(data: bytes) -> np.ndarray:
    """The server's audio path, spelled out: decode, average channels, resample (scipy)."""
    import soundfile
    from scipy.signal import resample_poly

    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = samples.mean(axis=1)
    return mono if rate == CLAP_SAMPLING_RATE else resample_poly(mono, CLAP_SAMPLING_RATE // rate, 1).astype(np.float32)


def maxsim_reference(query: np.ndarray, docs: list[np.ndarray]) -> np.ndarray:
    return np.array([(query @ d.T).max(axis=1).sum() for d in docs])


# ------------------------------------------------------------------- kinds
def test_list_models_shows_the_kinds(stub, rest):
    kinds = {m.id: m.kind for m in stub.ListModels(pb.ListModelsRequest()).models}
    assert kinds == {
        "clip": "clip",
        "clap": "clap",
        "colbert": "colbert",
        "clip_patches": "clip_patches",
        "splade": "sparse",
    }
    dims = {m["id"]: m["dimensions"] for m in rest.get("/v1/models").json()["data"]}
    assert dims == {"clip": 16, "clap": 16, "colbert": 16, "clip_patches": 16, "splade": 30522}


# -------------------------------------------------------------------- CLIP
def test_clip_texts_and_images_share_one_request_and_match_transformers(stub, refs, site):
    text_ref, _ = refs.clip_text(CLIP_TEXTS)
    image_ref, _ = refs.clip_images(IMAGES)
    data_uri = "data:image/jpeg;base64," + base64.b64encode(encoded(IMAGES[2], "PNG")).decode()
    inputs = [
        pb.Content(text=CLIP_TEXTS[0]),
        image_content(PNG),
        pb.Content(text=CLIP_TEXTS[1]),
        image_content(encoded(IMAGES[1], "BMP")),
        pb.Content(image=pb.Media(url=data_uri)),
        pb.Content(text=CLIP_TEXTS[2]),
        pb.Content(image=pb.Media(url=site + "/cat.png")),
        pb.Content(image=pb.Media(url=site + "/redirect")),
    ]
    expected = np.stack(
        [text_ref[0], image_ref[0], text_ref[1], image_ref[1], image_ref[2], text_ref[2], image_ref[0], image_ref[0]]
    )
    raw = stub.EmbedMultimodal(pb.EmbedMultimodalRequest(model="clip", inputs=inputs, normalize=False))
    np.testing.assert_allclose(vectors(raw.embeddings), expected, atol=TOL)
    normalized = stub.EmbedMultimodal(pb.EmbedMultimodalRequest(model="clip", inputs=inputs))  # clip default
    np.testing.assert_allclose(vectors(normalized.embeddings), unit(expected), atol=TOL)
    # Usage: tokens for texts; an image counts its ViT sequence, (32 / 8)^2 patches + 1.
    tokens = sum(len(refs.clip_processor.tokenizer(t).input_ids) for t in CLIP_TEXTS)
    assert raw.usage.prompt_tokens == tokens + 5 * 17


def test_clip_text_through_embed_equals_multimodal(stub, refs):
    text_ref, _ = refs.clip_text(CLIP_TEXTS)
    response = stub.Embed(pb.EmbedRequest(model="clip", inputs=CLIP_TEXTS))
    np.testing.assert_allclose(vectors(response.embeddings), unit(text_ref), atol=TOL)


# -------------------------------------------------------------------- CLAP
def test_clap_audio_and_text_match_transformers(stub, refs, site):
    waves = [decode_wave(d) for d in (WAV, STEREO_WAV, FLAC_8K)]
    audio_ref = refs.clap_audio(waves)
    text_ref = refs.clap_text(["a tone", "a dog barking"])
    inputs = [
        pb.Content(audio=pb.Media(data=WAV)),
        pb.Content(text="a tone"),
        pb.Content(audio=pb.Media(data=STEREO_WAV)),
        pb.Content(audio=pb.Media(data=FLAC_8K)),
        pb.Content(audio=pb.Media(url=site + "/tone.wav")),
        pb.Content(text="a dog barking"),
    ]
    response = stub.EmbedMultimodal(pb.EmbedMultimodalRequest(model="clap", inputs=inputs))
    expected = np.stack([audio_ref[0], text_ref[0], audio_ref[1], audio_ref[2], audio_ref[0], text_ref[1]])
    np.testing.assert_allclose(vectors(response.embeddings), expected, atol=TOL)
    # An audio clip counts its spectrogram frames: 1 s windows at hop 320 -> 51.
    assert response.usage.prompt_tokens == 4 * 51 + len(refs.clap_tokenizer("a tone").input_ids) + len(
        refs.clap_tokenizer("a dog barking").input_ids
    )


# ----------------------------------------------------------- late interaction
def test_colbert_token_vectors_match_transformers(stub, refs):
    texts = ["hello world", "a much longer sentence about late interaction retrieval", "x"]
    response = stub.EmbedMultiVector(
        pb.EmbedMultiVectorRequest(model="colbert", inputs=[pb.Content(text=t) for t in texts])
    )
    expected = refs.colbert_tokens(texts)
    assert response.dimensions == 16
    assert [e.rows for e in response.embeddings] == [len(e) for e in expected]
    for got, want in zip(response.embeddings, expected, strict=True):
        np.testing.assert_allclose(np.array(got.values).reshape(got.rows, 16), want, atol=TOL)
    assert response.usage.prompt_tokens == sum(len(e) for e in expected)


def test_clip_patches_patch_and_token_vectors(stub, refs):
    response = stub.EmbedMultiVector(
        pb.EmbedMultiVectorRequest(
            model="clip_patches",
            inputs=[image_content(PNG), pb.Content(text=CLIP_TEXTS[1]), image_content(encoded(IMAGES[1]))],
        )
    )
    image_emb, patches = refs.clip_images(IMAGES[:2])
    text_emb, tokens = refs.clip_text([CLIP_TEXTS[1]])
    got = [np.array(e.values).reshape(e.rows, 16) for e in response.embeddings]
    assert [len(g) for g in got] == [17, len(tokens[0]), 17]  # 16 patches + CLS per image; real tokens per text
    for g, want in zip(got, [patches[0], tokens[0], patches[1]], strict=True):
        np.testing.assert_allclose(g, want, atol=TOL)
    # Tied to CLIP itself: the CLS vector is the CLIP image embedding, the end token's the text embedding.
    np.testing.assert_allclose(got[0][0], unit(image_emb[0]), atol=TOL)
    np.testing.assert_allclose(got[1][-1], unit(text_emb[0]), atol=TOL)


def test_maxsim_ranks_text_documents_like_numpy(stub, refs):
    query = "how do search engines rank"
    response = stub.MaxSim(
        pb.MaxSimRequest(
            model="colbert",
            query=query,
            return_documents=True,
            top_n=2,
            documents=[pb.Content(text=d) for d in COLBERT_DOCS],
        )
    )
    expected = maxsim_reference(refs.colbert_tokens([query])[0], refs.colbert_tokens(COLBERT_DOCS))
    order = np.argsort(-expected)[:2]
    assert [r.index for r in response.results] == order.tolist()
    np.testing.assert_allclose([r.relevance_score for r in response.results], expected[order], atol=TOL)
    assert [r.document for r in response.results] == [COLBERT_DOCS[i] for i in order]


def test_maxsim_over_page_images_and_texts(stub, refs):
    query = "a red car"
    documents = [image_content(encoded(img)) for img in IMAGES] + [pb.Content(text="a photo of a dog")]
    response = stub.MaxSim(pb.MaxSimRequest(model="clip_patches", query=query, documents=documents))
    _, patches = refs.clip_images(IMAGES)
    _, query_tokens = refs.clip_text([query])
    _, doc_tokens = refs.clip_text(["a photo of a dog"])
    expected = maxsim_reference(query_tokens[0], patches + doc_tokens)
    scores = {r.index: r.relevance_score for r in response.results}
    np.testing.assert_allclose([scores[i] for i in range(4)], expected, atol=TOL)
    assert [r.index for r in response.results] == np.argsort(-expected, kind="stable").tolist()


# ------------------------------------------------------------------ sparse
def test_splade_vectors_match_the_reference(stub, refs):
    texts = ["sparse lexical retrieval", "hello world", "the quick brown fox jumps over the lazy dog"]
    expected = refs.splade(texts)
    response = stub.EmbedSparse(pb.EmbedSparseRequest(model="splade", inputs=texts))
    assert response.dimensions == 30522
    for got, want in zip(response.embeddings, expected, strict=True):
        assert list(got.indices) == sorted(got.indices)
        dense = np.zeros(30522)
        dense[list(got.indices)] = got.values
        np.testing.assert_allclose(dense, want, atol=TOL)
    top = stub.EmbedSparse(pb.EmbedSparseRequest(model="splade", inputs=texts, top_k=8, threshold=0.05))
    for got, want in zip(top.embeddings, expected, strict=True):
        best = np.sort(np.argsort(-want)[:8])
        assert list(got.indices) == best.tolist() and all(v > 0.05 for v in got.values)
        np.testing.assert_allclose(got.values, want[best], atol=TOL)


# -------------------------------------------------------------------- REST
def test_infinity_rest_routes(rest, refs, site):
    image_ref, _ = refs.clip_images(IMAGES[:1])
    data_uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    bodies = [
        ("/embeddings", {"model": "clip", "modality": "image", "input": [data_uri, site + "/cat.png"]}),
        ("/v1/embeddings_image", {"model": "clip", "input": data_uri}),
        ("/embeddings_image", {"model": "clip", "input": [base64.b64encode(PNG).decode()]}),
    ]  # bare base64
    for path, body in bodies:
        response = rest.post(path, json=body)
        assert response.status_code == 200, response.text
        got = np.array([d["embedding"] for d in response.json()["data"]])
        np.testing.assert_allclose(got, np.repeat(unit(image_ref), len(got), axis=0), atol=TOL)
    audio = rest.post(
        "/embeddings_audio",
        json={
            "model": "clap",
            "input": "data:audio/wav;base64," + base64.b64encode(WAV).decode(),
            "encoding_format": "base64",
        },
    )
    assert audio.status_code == 200, audio.text
    got = np.frombuffer(base64.b64decode(audio.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(got, refs.clap_audio([decode_wave(WAV)])[0], atol=TOL)
    text = rest.post("/v1/embeddings", json={"model": "clip", "input": CLIP_TEXTS[0]})
    np.testing.assert_allclose(
        text.json()["data"][0]["embedding"], unit(refs.clip_text(CLIP_TEXTS[:1])[0][0]), atol=TOL
    )


def test_rest_multivector_and_sparse(rest, refs):
    response = rest.post("/embeddings", json={"model": "colbert", "input": ["hello world"]})
    assert response.status_code == 200, response.text
    vectors = np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)
    np.testing.assert_allclose(vectors, refs.colbert_tokens(["hello world"])[0], atol=TOL)
    # base64: an input's vectors as one flat little-endian float32 buffer, the same values exactly
    packed = rest.post("/embeddings", json={"model": "colbert", "input": ["hello world"], "encoding_format": "base64"})
    flat = np.frombuffer(base64.b64decode(packed.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(flat.reshape(vectors.shape), vectors)
    maxsim = rest.post(
        "/v1/encoderd/maxsim",
        json={"model": "colbert", "query": "cat", "documents": [{"text": d} for d in COLBERT_DOCS]},
    ).json()
    assert sorted(r["index"] for r in maxsim["results"]) == [0, 1, 2]
    sparse = rest.post("/v1/encoderd/embed_sparse", json={"model": "splade", "inputs": ["hello"], "top_k": 3}).json()
    assert len(sparse["embeddings"][0]["indices"]) == 3


# --------------------------------------------------------------- bad media
CORRUPT_PNG = PNG[:60] + b"\0" * 40
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
BAD_MEDIA = [
    ("clip", pb.Content(image=pb.Media(data=b"definitely not an image")), "not an image in a supported format"),
    ("clip", pb.Content(image=pb.Media(data=CORRUPT_PNG)), "cannot decode the image"),
    ("clip", pb.Content(image=pb.Media(data=EPS)), "not an image in a supported format"),
    ("clip", pb.Content(image=pb.Media(data=b"\x89PNG" + b"\0" * MAX_MEDIA_BYTES)), "the limit is 262144"),
    ("clip", pb.Content(image=pb.Media(data=b"")), "is empty"),
    ("clip", pb.Content(image=pb.Media(url="data:image/png;base64,!!!notbase64")), "invalid base64"),
    ("clip", pb.Content(image=pb.Media(url="ftp://127.0.0.1/cat.png")), "only http(s) URLs"),
    ("clip", pb.Content(image=pb.Media(url="SITE/missing.png")), "HTTP 404"),
    ("clip", pb.Content(image=pb.Media(url="SITE/big.png")), "the limit is 262144"),
    ("clip", pb.Content(image=pb.Media(url="SITE/trickle")), "larger than the limit"),
    ("clip", pb.Content(image=pb.Media(url="SITE/slow")), "timed out"),
    ("clip", pb.Content(image=pb.Media(url="UNREACHABLE/cat.png")), "cannot fetch"),
    ("clip", pb.Content(audio=pb.Media(data=WAV)), "is audio, but model 'clip' (clip) takes text and image"),
    ("clap", pb.Content(audio=pb.Media(data=b"RIFF....WAVEfmt garbage")), "not audio in a supported format"),
    ("clap", pb.Content(audio=pb.Media(data=PNG)), "not audio in a supported format"),
    ("clap", pb.Content(audio=pb.Media(data=LOUD_WAV)), "samples reach 1.5e+37, so far outside [-1, 1]"),
    ("clap", image_content(PNG), "is an image, but model 'clap' (clap) takes text and audio"),
    ("clip", pb.Content(), "sets none of text, image, audio"),
]


@pytest.mark.parametrize("model,content,message", BAD_MEDIA, ids=[m for _, _, m in BAD_MEDIA])
def test_bad_media_is_invalid_argument(stub, site, model, content, message):
    content = _resolve_urls(content, site)
    with pytest.raises(grpc.RpcError) as error:
        stub.EmbedMultimodal(
            pb.EmbedMultimodalRequest(model=model, inputs=[pb.Content(text="a cat"), content]), timeout=30
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert message in error.value.details() and "inputs[1]" in error.value.details()


def _resolve_urls(content: pb.Content, site: str) -> pb.Content:
    which = content.WhichOneof("content")
    if which in ("image", "audio") and content.image.url.startswith(("SITE", "UNREACHABLE")):
        url = content.image.url.replace("SITE", site).replace("UNREACHABLE", f"http://127.0.0.1:{free_port()}")
        return pb.Content(image=pb.Media(url=url))
    return content


def test_bad_media_over_rest_is_400(rest):
    cases = [
        ("/embeddings_image", {"model": "clip", "input": "data:image/png;base64,AAAA"}),
        ("/embeddings", {"model": "clip", "modality": "video", "input": "x"}),
        ("/embeddings_audio", {"model": "clap", "input": [123]}),
        ("/embeddings_audio", {"model": "clap", "input": "bm90IGF1ZGlv"}),
    ]
    for path, body in cases:
        response = rest.post(path, json=body)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_argument"


def _corrupted(original: bytes, edits: list[tuple[int, int]], cut: int) -> bytes:
    data = bytearray(original[: max(cut, 8)])
    for position, value in edits:
        data[position % len(data)] = value
    return bytes(data)


def _damaged(original: bytes):
    """A real file with a few bytes overwritten and maybe cut short: the decoders' deep paths."""
    return st.builds(
        _corrupted,
        st.just(original),
        st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
        st.integers(8, len(original)),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    case=st.tuples(st.just("image"), st.binary(max_size=512) | _damaged(PNG) | _damaged(encoded(IMAGES[1], "JPEG")))
    | st.tuples(st.just("audio"), st.binary(max_size=512) | _damaged(WAV) | _damaged(FLAC_8K))
)
def test_fuzzed_media_is_a_result_or_invalid_argument(stub, case):
    modality, data = case
    media = pb.Media(data=data)
    content = pb.Content(image=media) if modality == "image" else pb.Content(audio=media)
    try:
        response = stub.EmbedMultimodal(
            pb.EmbedMultimodalRequest(model="clip" if modality == "image" else "clap", inputs=[content]), timeout=30
        )
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    else:  # a damaged file may still decode: then it is an embedding like any other
        assert np.isfinite(vectors(response.embeddings)).all()


def test_server_stays_healthy_after_bad_media(server, stub, refs):
    """Runs after the bad-media tests: no worker died or restarted, and every model still serves."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    models = stub.ListModels(pb.ListModelsRequest()).models
    assert all(r.restarts == 0 and r.status == "ready" for m in models for r in m.replicas)
    image_ref, _ = refs.clip_images(IMAGES[:1])
    response = stub.EmbedMultimodal(pb.EmbedMultimodalRequest(model="clip", inputs=[image_content(PNG)]))
    np.testing.assert_allclose(vectors(response.embeddings)[0], unit(image_ref[0]), atol=TOL)
