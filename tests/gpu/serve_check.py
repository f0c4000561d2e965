"""A real `encoderd serve --device D --no-rest` end to end, phase (b) of tests/gpu/device_check.sh.

One server with an embedder (the default MiniLM), a reranker and a classifier (tests/support/models.py,
built from that MiniLM), the dtype left to the server (--dtype auto: float16 on CUDA). Checked:
  * every model's fidelity self-check passed, each replica on the device asked for;
  * Embed against sentence-transformers float32 on the same weights (min cosine per the dtype's floor);
  * EmbedStream gives the same vectors as Embed (to the dtype's rounding), each under its own id;
  * Rerank orders as the sentence-transformers CrossEncoder does (Kendall tau), Classify's best label
    agrees with it on most inputs;
  * kill -9 of the embedder's worker: the supervisor restarts it (new pid, ready) and Embed answers
    the same vectors again.
Prints one line per check; exit status 1 on the first failure (its message says what was seen).

    python tests/gpu/serve_check.py DEVICE WORKDIR
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # the tests' `support` package

from support.models import build_classifier, build_reranker  # noqa: E402 - after the path above
from support.server import ServerProcess  # noqa: E402

from encoderd.v1 import encoderd_pb2 as pb  # noqa: E402
from encoderd.workers.contract.model_files import default_model_path  # noqa: E402

TEXTS = [
    "A GPU serves embeddings for a search index.",
    "The weather in Lisbon is mild in winter.",
    "Wie spät ist es?",
    "encoderd batches requests from many clients",
    "short",
    "A much longer passage about rivers, mountains and the engines that carry freight across the plains " * 3,
]
QUERY = "where is the weather mild?"
MIN_COSINE = {"float32": 0.9999, "float16": 0.999, "bfloat16": 0.999}


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        raise SystemExit(1)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def kendall_tau(a: np.ndarray, b: np.ndarray) -> float:
    n, agree = len(a), 0
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    for i, j in pairs:
        agree += np.sign(a[i] - a[j]) == np.sign(b[i] - b[j])
    return 2 * agree / len(pairs) - 1


def classifier_logits(path: Path, texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokens = AutoTokenizer.from_pretrained(path)(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        return model(**tokens).logits.numpy()


def embed(stub, texts: list[str]) -> np.ndarray:
    reply = stub.Embed(pb.EmbedRequest(model="embed", inputs=texts), timeout=120)
    return np.array([e.values for e in reply.embeddings])


def main(device: str, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    minilm = default_model_path()
    reranker, classifier = build_reranker(work / "reranker"), build_classifier(work / "classifier")
    server = ServerProcess(
        *("--device", device, "--replicas", "1", "--dtype", "auto"),
        *("--model", f"embed={minilm}", "--model", f"reranker={reranker}", "--model", f"classifier={classifier}"),
        env={"ENCODERD_DTYPE": "", "ENCODERD_REPLICAS": ""},  # the tests' pins do not apply here
        log_path=work / "server.log",
    )
    started = time.monotonic()
    server.start(timeout=300)
    try:
        print(f"serving after {time.monotonic() - started:.1f}s (log {work / 'server.log'})", flush=True)
        stub = server.stub()
        models = check_models(stub, device)
        vectors = check_embed(stub, minilm, models["embed"].dtype)
        check_stream(stub, vectors)
        check_rerank(stub, reranker)
        check_classify(stub, classifier, list(models["classifier"].labels))
        check_recovery(stub, models["embed"].replicas[0], vectors)
    finally:
        server.stop()


def list_models(stub) -> dict:
    return {m.id: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}


def check_models(stub, device: str) -> dict:
    models = list_models(stub)
    for m in models.values():
        figures = ", ".join(f"{f.metric} {f.value:.5f} (bound {f.bound})" for f in m.fidelity)
        devices = [r.device for r in m.replicas]
        check(
            m.fidelity_status == "passed" and all(d.startswith(device) for d in devices),
            f"{m.id}: {m.engine} {m.dtype} on {devices}, fidelity {m.fidelity_status}: {figures}",
        )
    return models


def check_embed(stub, minilm: str, dtype: str) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(minilm, device="cpu").encode(TEXTS)
    got = embed(stub, TEXTS)
    cos = cosines(got, want).min()
    check(cos >= MIN_COSINE.get(dtype, 0.99), f"Embed vs sentence-transformers float32: min cosine {cos:.6f}")
    return got


def check_stream(stub, vectors: np.ndarray) -> None:
    requests = (
        pb.EmbedStreamRequest(model="embed" if i == 0 else "", id=f"t{i}", input=t) for i, t in enumerate(TEXTS)
    )
    streamed = {r.id: np.array(r.embedding.values) for r in stub.EmbedStream(requests, timeout=120)}
    # Equal to the dtype's rounding: the stream's first text rides in a batch of its own, and a reduced
    # dtype's products round differently with a batch's rows (oneDNN blocks by them): bfloat16 on a
    # Zen 5 CPU gave cosine 0.99998 for it, 1.0 for the others (which rode together as in Embed).
    same = len(streamed) == len(TEXTS) and all(
        cosines(streamed[f"t{i}"][None], vectors[i][None])[0] > 0.9999 for i in range(len(TEXTS))
    )
    check(same, f"EmbedStream: {len(streamed)} answers, each equal to Embed's")


def check_rerank(stub, reranker: Path) -> None:
    from sentence_transformers import CrossEncoder

    request = pb.RerankRequest(model="reranker", query=QUERY, documents=TEXTS, raw_scores=True)
    served = np.zeros(len(TEXTS))
    for r in stub.Rerank(request, timeout=60).results:
        served[r.index] = r.relevance_score
    reference = CrossEncoder(str(reranker), device="cpu").predict([(QUERY, t) for t in TEXTS])
    tau = kendall_tau(served, np.asarray(reference).reshape(-1))
    check(tau >= 0.97, f"Rerank vs CrossEncoder float32: Kendall tau {tau:.3f}")


def check_classify(stub, classifier: Path, labels: list[str]) -> None:
    classes = stub.Classify(pb.ClassifyRequest(model="classifier", inputs=TEXTS), timeout=60).results
    logits = classifier_logits(classifier, TEXTS)
    agree = sum(c.labels[0].label == labels[int(np.argmax(row))] for c, row in zip(classes, logits, strict=True))
    check(agree >= len(TEXTS) - 1, f"Classify: best label as transformers' on {agree}/{len(TEXTS)}")


def check_recovery(stub, replica, vectors: np.ndarray) -> None:
    """kill -9 of the embedder's worker: restarted (new pid, ready), then the same vectors."""
    os.kill(replica.pid, signal.SIGKILL)
    killed = time.monotonic()
    while True:
        (now,) = list_models(stub)["embed"].replicas
        if now.pid != replica.pid and now.status == "ready":
            break
        if time.monotonic() - killed > 180:
            check(False, f"worker restart within 180 s of kill -9 (status {now.status}, pid {now.pid})")
        time.sleep(0.2)
    again = embed(stub, TEXTS)
    check(
        cosines(again, vectors).min() > 0.99999,
        f"kill -9 of the worker (pid {replica.pid}): restarted as {now.pid} in {time.monotonic() - killed:.1f}s, "
        "same vectors",
    )


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], Path(sys.argv[2]))
