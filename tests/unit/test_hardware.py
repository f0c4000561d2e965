"""Issue 15.1: CPU feature detection from /proc/cpuinfo and the numeric policy chosen from it.

The flag lines are real ones (as Linux prints them) of the CPUs the policy distinguishes; no
model or library is loaded here.
"""

from __future__ import annotations

import pytest

from encoderd.workers.contract import hardware
from encoderd.workers.contract.hardware import (
    UnsupportedOnHardware,
    check_dtype,
    onnx_int8_recipe,
    parse_cpuinfo,
    read_cpu,
)

_BASE = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
    "syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid pni pclmulqdq ssse3 "
    "fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor "
    "lahf_lm abm 3dnowprefetch fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap "
    "clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves"
)
_AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"
# model name, the flags line beyond _BASE
CPUS = {
    # AMD EPYC Milan: AVX2 only. The host of the cosine-0.19 int8 embeddings.
    "zen3": (
        "AMD EPYC 7763 64-Core Processor",
        "mmxext fxsr_opt cmp_legacy svm extapic cr8_legacy sse4a misalignsse osvw topoext perfctr_core clzero "
        "xsaveerptr rdpru wbnoinvd arat npt umip pku ospke vaes vpclmulqdq rdpid overflow_recov succor fsrm",
    ),
    # AMD EPYC Genoa: AVX-512 with VNNI and bf16, no AVX-VNNI, no fp16.
    "zen4": (
        "AMD EPYC 9654 96-Core Processor",
        f"mmxext fxsr_opt cmp_legacy svm {_AVX512} avx512ifma avx512_bf16 clzero avx512vbmi umip pku "
        "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm",
    ),
    # Intel Xeon Sapphire Rapids: AMX.
    "spr": (
        "Intel(R) Xeon(R) Platinum 8480+",
        f"{_AVX512} avx512ifma avx_vnni avx512_bf16 wbnoinvd arat avx512vbmi umip pku ospke waitpkg "
        "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid "
        "bus_lock_detect cldemote movdiri movdir64b enqcmd fsrm md_clear serialize tsxldtrk pconfig "
        "arch_lbr amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities",
    ),
    # Intel Xeon Skylake-SP: AVX-512 without VNNI (its int8 GEMMs saturate like AVX2's).
    "skylake": (
        "Intel(R) Xeon(R) Platinum 8175M CPU @ 2.50GHz",
        f"{_AVX512} pku ospke arat md_clear flush_l1d arch_capabilities",
    ),
    # Intel Alder Lake: no AVX-512, but AVX-VNNI.
    "alderlake": (
        "12th Gen Intel(R) Core(TM) i7-12700K",
        "avx_vnni umip pku ospke waitpkg gfni vaes vpclmulqdq rdpid movdiri movdir64b fsrm serialize "
        "arch_lbr flush_l1d arch_capabilities",
    ),
}
GRAVITON3 = (
    "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
    "fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit "
    "uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\n"
)


def cpuinfo_text(name: str, processors: int = 2) -> str:
    model, extra = CPUS[name]
    block = (
        f"processor\t: {{n}}\nvendor_id\t: x\ncpu family\t: 25\nmodel name\t: {model}\n"
        f"flags\t\t: {_BASE} {extra}\nbugs\t\t: sysret_ss_attrs spectre_v1\n\n"
    )
    return "".join(block.format(n=n) for n in range(processors))


def host(name: str, mask: str = "") -> hardware.CpuInfo:
    return read_cpu(cpuinfo_text(name), mask=mask, arch="x86_64")


# ------------------------------------------------------------------ parsing
def test_parse_reads_model_and_flags_of_the_first_processor():
    model, flags = parse_cpuinfo(cpuinfo_text("spr"))
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert {
        "avx2",
        "avx512f",
        "avx512_vnni",
        "avx_vnni",
        "avx512_bf16",
        "amx_bf16",
        "amx_int8",
        "amx_tile",
        "avx512_fp16",
    } <= flags
    assert "bugs" not in flags and "sysret_ss_attrs" not in flags  # the next line is not flags


@pytest.mark.parametrize(
    "name,has,lacks",
    [
        ("zen3", {"avx2"}, {"avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8"}),
        ("zen4", {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, {"avx_vnni", "avx512_fp16", "amx_tile"}),
        ("skylake", {"avx512f", "avx512bw"}, {"avx512_vnni", "avx512_bf16"}),
        ("alderlake", {"avx2", "avx_vnni"}, {"avx512f", "avx512_vnni"}),
    ],
)
def test_parse_real_flag_lines(name, has, lacks):
    _, flags = parse_cpuinfo(cpuinfo_text(name))
    assert has <= flags and not (lacks & flags)


def test_arm_features_line():
    info = read_cpu(GRAVITON3, mask="", arch="aarch64")
    assert {"asimddp", "bf16", "i8mm"} <= info.flags and info.known
    assert info.int8_exact  # ARM's int8 dot products widen: nothing saturates


def test_no_cpuinfo_is_unknown_and_conservative(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "CPUINFO", str(tmp_path / "missing"))
    info = read_cpu(mask="", arch="x86_64")
    assert not info.known and info.flags == frozenset()
    assert "unknown" in info.describe()
    assert onnx_int8_recipe(info) == hardware.ONNX_INT8_UNSIGNED  # exact on every x86
    with pytest.raises(UnsupportedOnHardware):
        check_dtype("torch", "bfloat16", "cpu", info)
    dtype, why = hardware.choose_cpu_dtype("torch", info)
    assert dtype == "float32" and "unknown" in why and "no native" not in why  # the CPU is not blamed


# ------------------------------------------------------------------ the mask
def test_mask_removes_features_by_name_and_pattern():
    info = host("zen4", mask="avx512*, avx_vnni,amx*")
    assert "avx2" in info.flags and not any(f.startswith("avx512") for f in info.flags)
    assert {"avx512f", "avx512_vnni", "avx512_bf16"} <= info.masked
    assert info.flags | info.masked == host("zen4").flags and not info.flags & info.masked
    assert "masked by ENCODERD_CPU_FLAGS_MASK" in info.describe()


def test_mask_comes_from_the_environment_and_the_result_is_cached(monkeypatch):
    monkeypatch.setenv(hardware.MASK_ENV, "avx512*,avx_vnni,amx*")
    hardware.cpu.cache_clear()
    try:
        info = hardware.cpu()
        assert not info.has_any(hardware.VNNI_INT8) and hardware.cpu() is info
    finally:
        hardware.cpu.cache_clear()


# ------------------------------------------------------------------ recipes per CPU
@pytest.mark.parametrize(
    "name,recipe",
    [
        ("zen3", hardware.ONNX_INT8_UNSIGNED),
        ("skylake", hardware.ONNX_INT8_UNSIGNED),
        ("zen4", hardware.ONNX_INT8_SIGNED),
        ("spr", hardware.ONNX_INT8_SIGNED),
        ("alderlake", hardware.ONNX_INT8_SIGNED),
    ],
)
def test_onnx_int8_recipe_follows_vnni(name, recipe):
    assert onnx_int8_recipe(host(name)) == recipe


@pytest.mark.parametrize(
    "name,mask,rest",
    [
        ("zen4", "", "bfloat16"),
        ("spr", "", "bfloat16"),
        ("zen3", "", "float32"),
        ("alderlake", "", "float32"),  # VNNI without native bfloat16
        ("zen4", "avx512_bf16,amx_bf16", "float32"),
    ],
)
def test_torch_int8_computes_the_rest_in_bfloat16_only_where_it_is_native(name, mask, rest):
    assert hardware.torch_int8_rest_dtype(host(name, mask)) == rest


def test_masking_vnni_switches_the_onnx_recipe():
    assert onnx_int8_recipe(host("spr", mask="avx512_vnni,avx_vnni,amx_int8")) == hardware.ONNX_INT8_UNSIGNED
    assert onnx_int8_recipe(host("spr", mask="avx512_vnni,avx_vnni")) == hardware.ONNX_INT8_SIGNED  # AMX


# (cpu, engine, dtype) -> None if accepted, else words the refusal must contain
POLICY = [
    ("zen3", "torch", "bfloat16", ["avx512_bf16", "amx_bf16", "--dtype float32"]),
    ("zen3", "torch", "float16", ["avx512_fp16", "--dtype float32"]),
    ("zen3", "ctranslate2", "int8", ["VNNI", "avx512_vnni", "--engine onnx --dtype int8"]),
    ("zen3", "ctranslate2", "int8_float32", ["saturate", "--engine onnx --dtype int8"]),
    ("skylake", "ctranslate2", "int8", ["avx_vnni"]),
    ("zen3", "onnx", "int8", None),  # unsigned weights there
    ("zen3", "torch", "float32", None),
    ("zen4", "torch", "bfloat16", None),
    ("zen4", "torch", "float16", ["avx512_fp16", "or bfloat16 (this CPU has it)"]),
    ("zen4", "ctranslate2", "int8", ["accuracy floor", "even with VNNI", "--engine onnx --dtype int8"]),
    ("alderlake", "ctranslate2", "int8", ["accuracy floor"]),
    ("alderlake", "torch", "bfloat16", ["avx512_bf16"]),
    ("spr", "torch", "float16", None),
    ("spr", "torch", "bfloat16", None),
]


@pytest.mark.parametrize("name,engine,dtype,refusal", POLICY, ids=[f"{p[0]}-{p[1]}-{p[2]}" for p in POLICY])
def test_cpu_policy(name, engine, dtype, refusal):
    info = host(name)
    if refusal is None:
        check_dtype(engine, dtype, "cpu", info)
        return
    with pytest.raises(UnsupportedOnHardware) as raised:
        check_dtype(engine, dtype, "cpu", info)
    message = str(raised.value)
    assert all(word in message for word in refusal), message
    assert CPUS[name][0] in message  # which CPU it judged
    assert isinstance(raised.value, ValueError)  # start-up errors are ValueErrors across the backends


@pytest.mark.parametrize("capability,accepted", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_bfloat16_needs_ampere(capability, accepted):
    check_dtype("torch", "float16", "cuda:0", capability=capability)
    if accepted:
        check_dtype("torch", "bfloat16", "cuda:0", capability=capability)
        return
    with pytest.raises(UnsupportedOnHardware, match=r"compute capability 8\.0.*7\.5.*--dtype float16"):
        check_dtype("torch", "bfloat16", "cuda:1", capability=capability)


def test_this_host_is_described():
    info = hardware.cpu()
    print(f"\nthis host: {info.describe()}; onnx int8 recipe {onnx_int8_recipe(info)}")
    assert info.arch
