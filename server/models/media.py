"""Media inputs: where their bytes come from, decoding, and preprocessing.

Everything here blocks (HTTP fetches, image and audio decoding, resizing,
feature extraction) and runs in the registry's media thread pool, never on the
event loop; the worker only receives finished float32 tensors.

Each preprocessed input also gets a cost, in token-equivalents, which the
scheduler budgets batches with (server/scheduling/batching.py: MediaItem):
  * image: the vision transformer's sequence length, pixels / patch^2 + 1 (CLIP
    ViT-B/32 at 224 px: 50), so one --max-batch-tokens budget fits text and images;
    for a retrieval model (ColPali, ColQwen2) the tokens its language model reads,
    image tokens and prompt (server/models/retrieval.py);
  * audio: the spectrogram frames the audio tower sees (CLAP at 10 s: 1001).

Bad media (corrupt or unsupported bytes, too large, unreachable or slow URLs)
raise InvalidInput, which the API turns into INVALID_ARGUMENT / HTTP 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from math import gcd
from pathlib import Path

import numpy as np

from ..base.errors import InvalidInput, echo

log = logging.getLogger("encoderd.media")

# Pillow decodes these; others (EPS runs Ghostscript, for one) are refused before any decoding.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class Content:
    """One input of a multi-modal request: a text, or an image / audio clip given
    as encoded bytes or as a URL (http(s) or data:)."""

    modality: str = "text"  # "text" | "image" | "audio"
    text: str = ""
    data: bytes = b""
    url: str = ""


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 20 * 1024 * 1024  # per media input, encoded
    fetch_timeout: float = 10.0  # seconds for a whole URL fetch
    allow_urls: bool = True  # fetch http(s) URLs at all
    max_image_pixels: int = 50_000_000  # decoded; guards against decompression bombs
    max_audio_seconds: float = 600.0  # decoded


# ------------------------------------------------------------------ bytes
def media_bytes(content: Content, limits: MediaLimits, what: str) -> bytes:
    """The encoded file of a media input: given, in a data: URI, or fetched (blocking)."""
    if content.data:
        data = content.data
    elif content.url.startswith("data:"):
        data = data_uri_bytes(content.url, what)
    elif content.url.startswith(("http://", "https://")):
        data = fetch(content.url, limits, what)
    elif content.url:  # REST clients (Infinity's API) may send bare base64
        if "://" in content.url[:16]:
            raise InvalidInput(f"{what}: {echo(content.url)}: only http(s) URLs and data: URIs are fetched")
        data = base64_bytes(content.url, f"{what} (neither a data: URI, an http(s) URL nor base64)")
    else:
        raise InvalidInput(f"{what} is empty: give the {content.modality}'s bytes or a URL")
    if len(data) > limits.max_bytes:
        raise InvalidInput(f"{what} is {len(data)} bytes; the limit is {limits.max_bytes}")
    if not data:
        raise InvalidInput(f"{what} is empty")
    return data


def data_uri_bytes(uri: str, what: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep:
        raise InvalidInput(f"{what}: malformed data URI (no comma)")
    if header.endswith(";base64"):
        return base64_bytes(payload, what)
    return urllib.parse.unquote_to_bytes(payload)


def base64_bytes(text: str, what: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"{what}: invalid base64 ({exc})") from None


class _HttpRedirectsOnly(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) only (urllib would also follow ftp://)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.startswith(("http://", "https://")):
            raise urllib.error.HTTPError(newurl, code, f"redirect to a non-http(s) URL: {echo(newurl)}", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_opener = urllib.request.build_opener(_HttpRedirectsOnly())


def fetch(url: str, limits: MediaLimits, what: str) -> bytes:
    """GET `url` within limits.max_bytes and limits.fetch_timeout (the whole
    transfer, not each read: a server trickling bytes is cut off too)."""
    if not limits.allow_urls:
        raise InvalidInput(f"{what}: this server does not fetch URLs (--no-media-urls); send the bytes instead")
    deadline = time.monotonic() + limits.fetch_timeout
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "encoderd"})
        with _opener.open(request, timeout=limits.fetch_timeout) as response:
            declared = response.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > limits.max_bytes:
                raise InvalidInput(f"{what}: {echo(url)} is {declared} bytes; the limit is {limits.max_bytes}")
            return _read_bounded(response, limits.max_bytes, deadline, f"{what}: {echo(url)}")
    except urllib.error.HTTPError as exc:
        raise InvalidInput(f"{what}: fetching {echo(url)} failed: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
            raise InvalidInput(f"{what}: fetching {echo(url)} timed out after {limits.fetch_timeout:g}s") from None
        raise InvalidInput(f"{what}: cannot fetch {echo(url)}: {reason}") from None


def _read_bounded(response, max_bytes: int, deadline: float, what: str) -> bytes:
    chunks, total = [], 0
    while chunk := response.read(_CHUNK):
        total += len(chunk)
        if total > max_bytes:
            raise InvalidInput(f"{what} is larger than the limit of {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise TimeoutError()
        chunks.append(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------- decoders
def decode_image(data: bytes, limits: MediaLimits, what: str):
    # Malformed files make Pillow raise nearly anything (OSError, SyntaxError, struct.error...): whatever
    # decoding client bytes raises is the client's error, never a server one.
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise InvalidInput(f"{what} is not an image in a supported format ({', '.join(IMAGE_FORMATS)})") from None
    except Exception as exc:  # noqa: BLE001 - the decoder's own error, whatever it is, is about the client's bytes
        raise InvalidInput(f"{what}: cannot decode the image: {exc}") from None
    if image.width * image.height > limits.max_image_pixels:
        raise InvalidInput(f"{what} is {image.width}x{image.height} pixels; the limit is {limits.max_image_pixels}")
    try:
        image.load()  # decode now: truncated or corrupt data fails here, not in the processor
    except Exception as exc:  # noqa: BLE001 - the decoder's own error, whatever it is, is about the client's bytes
        raise InvalidInput(f"{what}: cannot decode the image: {exc}") from None
    return image


def decode_audio(data: bytes, limits: MediaLimits, rate: int, what: str) -> np.ndarray:
    """Mono float32 samples at `rate` Hz (channels averaged, resampled when needed)."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - libsndfile's verdict on client bytes
        raise InvalidInput(f"{what} is not audio in a supported format (WAV, FLAC, OGG, MP3...): {exc}") from None
    if info.samplerate <= 0 or info.frames / info.samplerate > limits.max_audio_seconds:
        raise InvalidInput(f"{what} lasts {info.duration:.0f}s; the limit is {limits.max_audio_seconds:g}s")
    _check_resampling(info.samplerate, rate, what)
    try:
        samples, source_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001 - libsndfile's verdict on client bytes
        raise InvalidInput(f"{what}: cannot decode the audio: {exc}") from None
    if samples.shape[0] == 0:
        raise InvalidInput(f"{what} holds no samples")
    if not np.isfinite(samples).all():
        raise InvalidInput(f"{what} holds non-finite samples (NaN or infinity)")
    return resample(samples.mean(axis=1), source_rate, rate)


# Polyphase filters grow with the rate ratio's terms: 44.1 kHz -> 48 kHz is 160/147, and every common
# rate pair stays far below this; an odd rate (999983 Hz) would need a filter of millions of taps.
MAX_RESAMPLING_TERM = 2000


def _check_resampling(source_rate: int, rate: int, what: str) -> None:
    common = gcd(source_rate, rate)
    if max(source_rate, rate) // common > MAX_RESAMPLING_TERM:
        raise InvalidInput(
            f"{what}: cannot resample {source_rate} Hz to the model's {rate} Hz; "
            f"use a common sample rate (8, 16, 22.05, 44.1, 48 kHz...)"
        )


def resample(samples: np.ndarray, source_rate: int, rate: int) -> np.ndarray:
    """Polyphase resampling (anti-aliased), exact for any integer rate pair."""
    if source_rate == rate:
        return samples
    from scipy.signal import resample_poly

    common = gcd(source_rate, rate)
    return resample_poly(samples, rate // common, source_rate // common).astype(np.float32)


# --------------------------------------------------------- preprocessing
@dataclass(frozen=True, slots=True)
class Preprocessed:
    """One media input as the worker takes it, and what it costs the batch budget."""

    features: np.ndarray  # float32: pixel values, audio features, or (ColQwen2) a page's patch rows
    cost: int  # token-equivalents (see the module's docstring)
    flag: int = 0  # per-input flag (CLAP: is_longer)
    ids: np.ndarray | None = None  # int32: the token sequence a retrieval processor built around the image
    grid: np.ndarray | None = None  # int32 (3,): the patch grid of a page in rows (ColQwen2)


class ImagePreprocessor:
    """Decode, then the model's own image processor: resize, crop, rescale,
    normalize exactly as its preprocessor config says."""

    modality = "image"

    def __init__(self, model_dir: str, limits: MediaLimits):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.limits = limits
        vision = _read_json(Path(model_dir) / "config.json").get("vision_config") or {}
        self.patch = int(vision.get("patch_size") or 16)

    def __call__(self, data: bytes, what: str) -> Preprocessed:
        image = decode_image(data, self.limits, what)
        try:
            pixels = self.processor(images=[image], return_tensors="np")["pixel_values"][0]
        except Exception as exc:  # noqa: BLE001 - exotic modes (16-bit, CMYK variants...) the processor rejects
            raise InvalidInput(f"{what}: cannot preprocess the image ({image.mode}, {image.size}): {exc}") from None
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        cost = (pixels.shape[-2] // self.patch) * (pixels.shape[-1] // self.patch) + 1
        return Preprocessed(pixels, cost)


class AudioPreprocessor:
    """Decode, resample to the model's rate, then its feature extractor. One clip
    per call: CLAP's extractor marks clips for feature fusion per batch, so a
    batch of one keeps each clip's features independent of its neighbours."""

    modality = "audio"

    def __init__(self, model_dir: str, limits: MediaLimits):
        from transformers import AutoFeatureExtractor

        self.extractor = AutoFeatureExtractor.from_pretrained(model_dir)
        self.rate = int(self.extractor.sampling_rate)
        self.limits = limits

    def __call__(self, data: bytes, what: str) -> Preprocessed:
        samples = decode_audio(data, self.limits, self.rate, what)
        try:
            out = self.extractor(samples, sampling_rate=self.rate, return_tensors="np")
        except Exception as exc:  # noqa: BLE001 - e.g. a clip too short for the extractor's window
            raise InvalidInput(f"{what}: cannot extract audio features: {exc}") from None
        features = np.ascontiguousarray(out["input_features"][0], dtype=np.float32)
        if not np.isfinite(features).all():  # finite samples far out of range (a float WAV may hold 1e37)
            raise InvalidInput(
                f"{what}: its samples reach {np.abs(samples).max():.3g}, so far outside [-1, 1] that its "
                "audio features overflow; send audio at a normal level"
            )
        is_longer = int(np.asarray(out.get("is_longer", [[False]])).reshape(-1)[0])
        return Preprocessed(features, int(features.shape[-2]), flag=is_longer)


PREPROCESSORS = {"image": ImagePreprocessor, "audio": AudioPreprocessor}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
