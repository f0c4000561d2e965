"""Issue 45: real ColPali (ColPaliForRetrieval, PaliGemma) and ColQwen2 (ColQwen2ForRetrieval,
Qwen2-VL) served by one real server (workers, Envoy), compared with transformers on the same tiny
seeded models: `model(**processor(...)).embeddings` per query and per page, and the processor's
`score_retrieval` for MaxSim."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from support.media import encoded, random_image
from support.multimodal_models import build_colpali, build_colqwen2
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb

pytest.importorskip("PIL")

TOL = 1e-5  # float32: the same forward, different batch neighbours
QUERIES = ["a red cat", "the invoice total with a chart", "x"]
MODELS = ("colpali", "colqwen2")


# Pages of different shapes: ColQwen2 reads each at its own resolution (4 to 64 image tokens here).
PAGES = [random_image(1, (70, 50)), random_image(2, (40, 90)), random_image(3, (20, 20)), random_image(4, (64, 64))]


@pytest.fixture(scope="module")
def paths(models_dir):
    return {"colpali": build_colpali(models_dir / "colpali"), "colqwen2": build_colqwen2(models_dir / "colqwen2")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, paths):
    proc = ServerProcess(
        "--model",
        f"colpali={paths['colpali']}",
        "--model",
        f"colqwen2={paths['colqwen2']}",
        "--cpu-threads",
        "1",
        rest=True,
        log_path=tmp_path_factory.mktemp("colpali") / "server.log",
    )
    proc.launch()
    yield proc
    assert proc.stop() == 0, proc.log_text()


class References:
    """transformers' own: the model's processor and forward, one input at a time (so no padding rows)."""

    def __init__(self, paths):
        import transformers

        torch.set_num_threads(1)
        classes = {"colpali": transformers.ColPaliForRetrieval, "colqwen2": transformers.ColQwen2ForRetrieval}
        self.processors = {name: transformers.AutoProcessor.from_pretrained(paths[name]) for name in MODELS}
        self.models = {name: classes[name].from_pretrained(paths[name]).eval() for name in MODELS}

    @torch.no_grad()
    def queries(self, name: str, texts: list[str]) -> list[torch.Tensor]:
        return [self.models[name](**self.processors[name](text=[t])).embeddings[0] for t in texts]

    @torch.no_grad()
    def pages(self, name: str, images) -> list[torch.Tensor]:
        return [self.models[name](**self.processors[name](images=[i])).embeddings[0] for i in images]

    def scores(self, name: str, query: str, images) -> np.ndarray:
        reference = self.processors[name].score_retrieval(self.queries(name, [query]), self.pages(name, images))
        return reference[0].numpy()

    def tokens(self, name: str, text: str | None = None, image=None) -> int:
        built = self.processors[name](text=[text]) if text is not None else self.processors[name](images=[image])
        return int(built["input_ids"].shape[1])


@pytest.fixture(scope="module")
def refs(launched, paths):
    return References(paths)  # built while the server's workers load


@pytest.fixture(scope="module")
def server(launched, refs):
    launched.wait_serving(240)
    launched.wait_rest(60)
    return launched


@pytest.fixture(scope="module")
def stub(server):
    return server.stub()


def rows_of(embedding, dim: int = 16) -> np.ndarray:
    return np.array(embedding.values, dtype=np.float32).reshape(embedding.rows, dim)


@pytest.mark.parametrize("name", MODELS)
def test_query_and_page_vectors_equal_transformers(stub, refs, name):
    """Queries (prefix and augmentation tokens as the processor builds them) and pages of four sizes,
    mixed in one request: every row equals the reference's, and the usage counts the tokens the
    language model read (ColQwen2: each page its own)."""
    inputs = [
        pb.Content(text=QUERIES[0]),
        pb.Content(image=pb.Media(data=encoded(PAGES[0]))),
        pb.Content(image=pb.Media(data=encoded(PAGES[1]))),
        pb.Content(text=QUERIES[1]),
        pb.Content(image=pb.Media(data=encoded(PAGES[2]))),
        pb.Content(image=pb.Media(data=encoded(PAGES[3]))),
        pb.Content(text=QUERIES[2]),
    ]
    response = stub.EmbedMultiVector(pb.EmbedMultiVectorRequest(model=name, inputs=inputs))
    query_refs, page_refs = refs.queries(name, QUERIES), refs.pages(name, PAGES)
    expected = [query_refs[0], *page_refs[:2], query_refs[1], *page_refs[2:], query_refs[2]]
    assert response.dimensions == 16
    assert [e.rows for e in response.embeddings] == [len(e) for e in expected]
    for got, want in zip(response.embeddings, expected, strict=True):
        np.testing.assert_allclose(rows_of(got), want.numpy(), atol=TOL)
        np.testing.assert_allclose(np.linalg.norm(rows_of(got), axis=1), 1.0, atol=1e-5)
    tokens = sum(refs.tokens(name, text=q) for q in QUERIES) + sum(refs.tokens(name, image=p) for p in PAGES)
    assert response.usage.prompt_tokens == tokens


def test_colqwen2_pages_cost_their_own_tokens(refs):
    """The premise of the budget test above: ColQwen2 pages of different sizes are different lengths."""
    lengths = {refs.tokens("colqwen2", image=p) for p in PAGES}
    assert len(lengths) == len(PAGES)


@pytest.mark.parametrize("name", MODELS)
def test_maxsim_equals_score_retrieval(stub, refs, name):
    query = "the chart of the report"
    documents = [pb.Content(image=pb.Media(data=encoded(p))) for p in PAGES]
    response = stub.MaxSim(pb.MaxSimRequest(model=name, query=query, documents=documents))
    expected = refs.scores(name, query, PAGES)
    scores = {r.index: r.relevance_score for r in response.results}
    np.testing.assert_allclose([scores[i] for i in range(len(PAGES))], expected, rtol=1e-5, atol=1e-5)
    assert [r.index for r in response.results] == np.argsort(-expected, kind="stable").tolist()


def test_rest_multivector_and_maxsim(server, refs):
    """The same over REST (Envoy's transcoder): a base64 page, a query, and MaxSim."""
    import base64

    page = base64.b64encode(encoded(PAGES[1])).decode()
    with httpx.Client(base_url=server.rest_url, timeout=60) as client:
        body = {"model": "colqwen2", "inputs": [{"text": QUERIES[1]}, {"image": {"data": page}}]}
        got = client.post("/v1/encoderd/embed_multivector", json=body)
        assert got.status_code == 200, got.text
        embeddings = got.json()["embeddings"]
        want = [refs.queries("colqwen2", [QUERIES[1]])[0], refs.pages("colqwen2", [PAGES[1]])[0]]
        for got_rows, want_rows in zip(embeddings, want, strict=True):
            values = np.array(got_rows["values"], dtype=np.float32).reshape(-1, 16)
            np.testing.assert_allclose(values, want_rows.numpy(), atol=TOL)
        body = {"model": "colpali", "query": "a red cat", "documents": [{"image": {"data": page}}]}
        got = client.post("/v1/encoderd/maxsim", json=body)
        assert got.status_code == 200, got.text
        score = got.json()["results"][0]["relevance_score"]
        np.testing.assert_allclose(score, refs.scores("colpali", "a red cat", [PAGES[1]])[0], rtol=1e-5)


def test_list_models_names_the_kind_and_the_fidelity_check(stub):
    """The self-check covers multi-vector output now: float32 rows against transformers' own loop."""
    infos = {m.id: m for m in stub.ListModels(pb.ListModelsRequest()).models}
    assert {name: info.kind for name, info in infos.items()} == {"colpali": "colpali", "colqwen2": "colpali"}
    for info in infos.values():
        assert info.fidelity_status == "passed", info
        [cosine] = info.fidelity
        assert cosine.metric == "min_cosine" and cosine.bound == 0.9999 and cosine.value >= 0.99999


def test_bfloat16_is_checked_and_within_its_floor(tmp_path, paths, refs):
    """--dtype bfloat16: the self-check measures every query and page row against float32
    transformers (floor 0.999), and what is served stays within that floor of the reference.
    The float32 reference is computed (a fresh cache) before the served model loads, so a start-up
    holds one copy of the weights at a time; on the old code it came after load and warm-up."""
    with ServerProcess(
        "--model",
        f"colqwen2={paths['colqwen2']}",
        "--dtype",
        "bfloat16",
        "--cpu-threads",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
        log_path=tmp_path / "server.log",
    ) as server:
        [info] = server.stub().ListModels(pb.ListModelsRequest()).models
        assert (info.dtype, info.fidelity_status) == ("bfloat16", "passed")
        [cosine] = info.fidelity
        assert cosine.bound == 0.999 and 0.999 <= cosine.value < 1.0
        inputs = [pb.Content(text=QUERIES[1]), pb.Content(image=pb.Media(data=encoded(PAGES[0])))]
        response = server.stub().EmbedMultiVector(pb.EmbedMultiVectorRequest(model="colqwen2", inputs=inputs))
    want = [refs.queries("colqwen2", [QUERIES[1]])[0].numpy(), refs.pages("colqwen2", [PAGES[0]])[0].numpy()]
    for got, reference in zip(response.embeddings, want, strict=True):
        rows = rows_of(got)
        assert rows.shape == reference.shape
        assert (rows * reference).sum(axis=1).min() >= 0.999  # unit rows: the dot is the cosine
    log = server.log_text()
    assert "fidelity self-check passed: colqwen2 (torch bfloat16 on cpu)" in log
    assert "reference computed]" in log  # made at this start, not read from a cache
    assert log.index("computing the float32 reference of colqwen2") < log.index("loaded in")


def test_bad_inputs_are_refused_clearly(server, stub):
    import grpc

    with pytest.raises(grpc.RpcError) as refused:
        stub.EmbedMultiVector(
            pb.EmbedMultiVectorRequest(model="colpali", inputs=[pb.Content(image=pb.Media(data=b"not an image"))])
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not an image" in refused.value.details()
    long_query = " ".join(["invoice"] * 300)  # past the tiny ColPali's 256 positions with its prefix
    with pytest.raises(grpc.RpcError) as refused:
        stub.EmbedMultiVector(pb.EmbedMultiVectorRequest(model="colpali", inputs=[pb.Content(text=long_query)]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "augmentation tokens" in refused.value.details()
    with httpx.Client(base_url=server.rest_url, timeout=60) as client:
        got = client.post("/v1/encoderd/maxsim", json={"model": "colqwen2", "query": "", "documents": [{"text": "a"}]})
        assert got.status_code == 400, got.text
