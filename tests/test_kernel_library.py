"""The CPU kernel library as the package builds it: every variant built at install, the one
this CPU runs chosen at run time (or the one asked for), and each function bound with the
signature the library itself declares (vlmd/layers/cpu/kernels.h)."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlmd.layers.cpu import decoder_step, elementwise, library, packed_linear, paged_decode, paged_prefill, variants

NATIVE = Path(library.__file__).parent
HOST_FLAGS = variants.cpu_flags()
BUILT = library.built_variants()
needs_library = pytest.mark.skipif(not BUILT, reason="no kernel library was built in this install")

AVX512_HOST = variants.VARIANTS[0].needs  # an AVX-512 CPU's flags (x86-64-v4)
AVX2_HOST = variants.VARIANTS[1].needs  # an AVX2 one's (x86-64-v3)


def test_the_best_variant_the_cpu_runs_is_chosen():
    built = {name: Path(name) for name in variants.NAMES}
    assert library.choose("auto", built, AVX512_HOST) == "x86-64-v4"
    assert library.choose("auto", built, AVX2_HOST) == "x86-64-v3"
    assert library.choose("auto", {"x86-64-v3": Path("v3")}, AVX512_HOST) == "x86-64-v3"  # v4 not built
    assert library.choose("auto", {}, AVX512_HOST) is None
    assert library.choose("x86-64-v3", built, AVX512_HOST) == "x86-64-v3"  # AVX2 forced on an AVX-512 CPU


@pytest.mark.parametrize("requested,built,flags,says", [
    ("x86-64-v4", {"x86-64-v4": Path("v4")}, AVX2_HOST, "cannot run"),
    ("x86-64-v3", {"x86-64-v4": Path("v4")}, AVX512_HOST, "not built"),
    ("avx9000", {}, AVX512_HOST, "not a kernel variant"),
])
def test_a_variant_asked_for_must_be_known_built_and_runnable(requested, built, flags, says):
    with pytest.raises(ValueError, match=says):
        library.choose(requested, built, flags)


def test_cpu_flags_are_read_from_cpuinfo():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\n"
    assert variants.cpu_flags(text) == {"fpu", "avx2", "avx512f"}
    assert variants.cpu_flags("Features\t: fp asimd\n") == {"fp", "asimd"}
    assert variants.cpu_flags("nothing here\n") == frozenset()
    assert [v.name for v in variants.for_machine("aarch64")] == ["generic"]
    assert [v.name for v in variants.runnable(AVX2_HOST, "x86_64")] == ["x86-64-v3", "x86-64-v2"]


def test_signatures_are_read_into_ctypes_types():
    parsed = library.Signature.parse("int f(const float *x, int64_t n, float eps, int threads, const struct s *p)")
    assert parsed.name == "f" and parsed.restype is ctypes.c_int
    assert parsed.argtypes == (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p)
    assert library.Signature.parse("int g(void)").argtypes == ()
    with pytest.raises(ValueError, match="cannot pass"):
        library.Signature.parse("int h(size_t n)")
    with pytest.raises(ValueError, match="cannot read"):
        library.Signature.parse("struct s k(int n)")


def test_the_header_declares_every_function_the_sources_export():
    # Each source includes kernels.h, so the compiler checks definitions against it; here:
    # nothing exported escapes the header.
    header = (NATIVE / "kernels.h").read_text()
    declared = set(re.findall(r"X\(\w+, (vlmd_\w+),", header))
    defined = set()
    for source in NATIVE.glob("*.c"):
        text = source.read_text()
        assert '#include "kernels.h"' in text, source.name
        defined |= set(re.findall(r"^int (vlmd_\w+)\(", text, re.M))
        defined |= set(re.findall(r"^LAYOUT_MATCHES\((vlmd_\w+),", text, re.M))
    assert defined == declared


@needs_library
def test_every_variant_of_this_machine_is_built():
    # CI installs with a compiler that has every level (gcc >= 11): all of them are built,
    # those this CPU cannot run included.
    assert set(BUILT) == {v.name for v in variants.for_machine()}


@needs_library
@pytest.mark.parametrize("name", [v.name for v in variants.runnable(HOST_FLAGS)])
def test_each_runnable_variant_declares_what_the_bindings_bind(name):
    opened = library.open_library(name, BUILT[name])
    assert opened.variant == name
    bindings = (packed_linear._NAMES, paged_decode._NAMES, paged_prefill._NAMES, elementwise._NAMES,
                decoder_step._NAMES)
    for names in bindings:
        bound = opened.bind(names, hold_gil=False)
        assert set(bound) == set(names)
    with pytest.raises(RuntimeError, match="declares no"):
        opened.bind(("vlmd_no_such_kernel",), hold_gil=False)


@needs_library
def test_the_variant_is_forced_from_the_environment_and_a_bad_one_is_refused():
    runnable = [v.name for v in variants.runnable(HOST_FLAGS) if v.name in BUILT]
    code = "from vlmd.layers.cpu import library\nprint(library.load().variant)\n"
    for name in runnable:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, library.ENV: name})
        assert done.returncode == 0 and done.stdout.split()[-1] == name, done.stderr
    unrunnable = [v.name for v in variants.for_machine() if v.name not in runnable]
    if unrunnable:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, library.ENV: unrunnable[0]})
        assert done.returncode != 0 and "cannot run" in done.stderr


RUNNABLE_BUILT = [v.name for v in variants.runnable(HOST_FLAGS) if v.name in BUILT]


@pytest.mark.skipif(len(RUNNABLE_BUILT) < 2, reason="this CPU runs only one built kernel variant")
def test_a_lower_variant_forced_serves_the_oracle_s_tokens(tiny_llava_dir, tmp_path):
    # The AVX2 library on an AVX-512 host (here: the next level down from the best), with
    # every small product on vlmd's kernel: transformers' greedy tokens, two requests at once.
    from concurrent.futures import ThreadPoolExecutor

    from conftest import Server, image_message, random_image
    from oracle import assert_greedy_match, hf_llava_generate

    forced = "x86-64-v3" if "x86-64-v3" in RUNNABLE_BUILT[1:] else RUNNABLE_BUILT[1]
    server = Server(tiny_llava_dir, "--cpu-kernels", forced, "--linear-kernels", "native", log_dir=tmp_path)
    try:
        images = [random_image(131), random_image(132)]

        def ask(image):
            status, body = server.chat({"messages": image_message("What is this?", image), "max_tokens": 10,
                                        "temperature": 0, "return_token_ids": True})
            assert status == 200, body
            return body

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(ask, images))
        assert f'"variant": "{forced}"' in server.log_path.read_text()
        for image, answer in zip(images, answers):
            reference = hf_llava_generate(tiny_llava_dir, [{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": "What is this?"}]}], [image], 10)
            assert answer["prompt_token_ids"] == reference["prompt_token_ids"]
            assert_greedy_match(answer["choices"][0]["token_ids"], reference)
    finally:
        server.stop()


def test_serve_refuses_a_variant_this_cpu_cannot_run(tiny_llava_dir):
    unrunnable = [v.name for v in variants.for_machine() if v.name not in RUNNABLE_BUILT]
    if not unrunnable:
        pytest.skip("this CPU runs every variant built for its machine")
    done = subprocess.run([sys.executable, "-m", "vlmd", "serve", str(tiny_llava_dir), "--port", "1",
                           "--cpu-kernels", unrunnable[0]], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"vlmd serve: --cpu-kernels {unrunnable[0]}: this CPU cannot run it" in done.stderr, done.stderr
