"""A user's host CPU and memory, described the way they know it — cores, vector ISA, memory channels
and their speed, NUMA nodes, installed RAM — for `advise`, which asks what their experts would run
at on it. Built-in presets cite the vendor's page; `--cpu cores=16,isa=avx512,channels=2,mts=6000`
describes any other. What the CPU streams from DRAM is the spec's peak (channels x MT/s x 8 bytes)
times the share a STREAM-like read reaches (`READ_SHARE`, measured), unless the user gives their own
measurement (`bw=GB/s`, e.g. from `klotski-runtime calibrate --cpu-only`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from klotski_sim.util.errors import UsageError
from klotski_sim.util.terminal import one_line

ISAS = ("avx2", "avx512", "amx")  # what decides llama.cpp's and KTransformers' CPU kernels

# The share of the channels' peak a multi-threaded read of large arrays reaches (a user's own
# measurement, bw=, replaces it). Two channels (desktops): 0.90 — AIDA64-style reads of dual-channel
# DDR4-3200, 46 of 51.2 GB/s (guru3d, G.Skill TridentZ Royal DDR4-3200 review p. 9-10), and of
# dual-channel DDR5-6400, ~95 of 102.4 GB/s (memtest86plus/memtest86plus#612). Eight channels and
# more (servers, whose chiplets each cap their reads): 0.75, the mean of EPYC 7402's one-socket
# AVX2 read, 116.0 of 170.6 GB/s (kvcache-ai/ktransformers PR #2175), and dual-socket EPYC Naples'
# STREAM triad, 250 of 307 GB/s (AnandTech, Skylake-SP vs EPYC review, p. 12).
READ_SHARE_DESKTOP = 0.90
READ_SHARE_SERVER = 0.75
SERVER_CHANNELS = 8
MAX_RAM_GIB = 65536  # (64 TiB: more than any one host holds; a larger figure is a typo)


@dataclass(frozen=True)
class HostCpu:
    """The host: its CPU (`cores` physical, `isa`), `channels` of DDR at `mts` MT/s over `numa`
    nodes (0 and 0 where only a measurement is known), `ram_bytes` installed; `measured_bandwidth`
    (bytes/s) when someone measured it."""

    name: str
    cores: int
    isa: str
    channels: int
    mts: int
    numa: int = 1
    ram_bytes: float = 0.0
    measured_bandwidth: float | None = None
    sources: tuple[str, ...] = field(default=(), compare=False)

    @property
    def peak_bandwidth(self) -> float:
        """Bytes/s of every channel at once: channels x MT/s x 8-byte bus."""
        return self.channels * self.mts * 1e6 * 8

    @property
    def read_share(self) -> float:
        return READ_SHARE_SERVER if self.channels >= SERVER_CHANNELS else READ_SHARE_DESKTOP

    @property
    def read_bandwidth(self) -> float:
        """What a read of the experts' weights streams at: the measurement, else the measured share of the peak."""
        return self.measured_bandwidth or self.peak_bandwidth * self.read_share

    def describe(self) -> str:
        measured = f"measured {self.measured_bandwidth / 1e9:.0f} GB/s" if self.measured_bandwidth else ""
        memory = (
            f"{self.channels}x DDR-{self.mts} ({self.peak_bandwidth / 1e9:.0f} GB/s peak{', ' if measured else ''}"
            f"{measured})"
            if self.channels
            else f"DRAM {measured}"
        )
        return f"{self.name}: {self.cores} cores {self.isa}, {memory}, {self.ram_bytes / 2**30:.0f} GiB"


def _preset(
    name: str, cores: int, isa: str, channels: int, mts: int, source: str, numa: int = 1, measured: float | None = None
) -> HostCpu:
    return HostCpu(name, cores, isa, channels, mts, numa, measured_bandwidth=measured, sources=(source,))


# Cores, ISA and memory of common hosts (docs/advise.md lists their sources in full; third-party
# spec pages quoting the vendors', as the notes say). Cores are physical cores.
CPU_PRESETS: dict[str, HostCpu] = {
    h.name: h
    for h in (
        _preset("ryzen-9-7950x", 16, "avx512", 2, 5200, "16 cores, AM5 dual-channel, DDR5-5200 (web-autoai.com spec page); "
                "AVX512=1 at runtime (ggml-org/llama.cpp#4716)"),
        _preset("ryzen-9-9900x", 12, "avx512", 2, 5600, "12 cores, DDR5 up to 5600 MT/s (technetbooks review); dual-channel "
                "(AM5); AVX-512 BF16 (ktransformers GPT-OSS-120B-Kernel-Work.md)"),
        _preset("i9-14900k", 24, "avx2", 2, 5600, "8P+16E cores, DDR5-5600 (gamerfridge review); no AVX-512 on Raptor Lake"),
        _preset("i9-10900x", 10, "avx512", 4, 2933, "10 cores, quad-channel DDR4 (llmfit PR #755); DDR4-2933, "
                "Cascade Lake-X's rated speed (Intel's figure, not read here)"),
        _preset("epyc-7343", 16, "avx2", 8, 3200, "16 cores (Milan); 8 channels of DDR4-3200 (AnandTech Milan review)"),
        _preset("threadripper-pro-5975wx", 32, "avx2", 8, 3200, "32 cores, 8 DDR4 channels (sweclockers); DDR4-3200 "
                "as the other Zen 3 platforms"),
        _preset("xeon-gold-6454s", 32, "amx", 8, 4800, "32 cores a socket, 8x DDR5-4800 each, AMX (KTransformers "
                "DeepseekR1_V3_tutorial.md)"),
        _preset("2x-xeon-gold-6454s", 64, "amx", 16, 4800, "two sockets of xeon-gold-6454s, 2 NUMA nodes "
                "(KTransformers DeepseekR1_V3_tutorial.md)", numa=2),
    )
}  # fmt: skip


def parse_cpu(text: str, ram_gib: float | None = None) -> HostCpu:
    """A preset's name, or `cores=C,isa=I,channels=N,mts=M[,numa=K][,ram=GiB][,bw=GB/s][,name=S]`:
    one line naming the field at fault otherwise. `ram_gib` (--ram) sets the installed memory."""
    if "=" not in text:
        try:
            host = CPU_PRESETS[text]
        except KeyError:
            raise UsageError(
                f"--cpu {text}: not a preset ({', '.join(CPU_PRESETS)}); or describe it: "
                f"cores=16,isa=avx512,channels=2,mts=6000[,numa=1][,ram=128][,bw=70]"
            ) from None
    else:
        fields: dict[str, str] = {}
        for part in text.split(","):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or not key:
                raise UsageError(f"--cpu {text}: {part!r} is not KEY=VALUE")
            if key in fields:
                raise UsageError(f"--cpu {text}: {key} given twice")
            fields[key] = value.strip()
        allowed = {"cores", "isa", "channels", "mts", "numa", "ram", "bw", "name"}
        unknown = sorted(set(fields) - allowed)
        if unknown:
            raise UsageError(f"--cpu: unknown field(s) {', '.join(unknown)} (fields: {', '.join(sorted(allowed))})")
        # (channels and speed give the peak a read share is taken of; a measured bw= needs neither)
        needed = ("cores", "isa") if "bw" in fields else ("cores", "isa", "channels", "mts")
        missing = [k for k in needed if k not in fields]
        if missing:
            raise UsageError(f"--cpu {text}: missing {', '.join(missing)} (or a measured bw=GB/s)")

        def number(key: str, low: float, high: float) -> float:
            try:
                value = float(fields[key])
            except ValueError:
                raise UsageError(f"--cpu: {key}={fields[key]!r} is not a number") from None
            if not low <= value <= high:
                raise UsageError(f"--cpu: {key}={fields[key]} is outside {low:g}..{high:g}")
            return value

        def whole(key: str, low: int, high: int) -> int:
            value = number(key, low, high)
            if value != int(value):
                raise UsageError(f"--cpu: {key}={fields[key]} must be a whole number")
            return int(value)

        isa = fields["isa"].lower()
        if isa not in ISAS:
            raise UsageError(f"--cpu: isa={fields['isa']} is not one of {', '.join(ISAS)}")
        host = HostCpu(
            fields.get("name", "custom CPU"),
            whole("cores", 1, 1024),
            isa,
            whole("channels", 1, 32) if "channels" in fields else 0,
            whole("mts", 800, 20000) if "mts" in fields else 0,
            whole("numa", 1, 16) if "numa" in fields else 1,
            number("ram", 1, MAX_RAM_GIB) * 2**30 if "ram" in fields else 0.0,
            number("bw", 1, 10000) * 1e9 if "bw" in fields else None,
            ("described on the command line",),
        )
    if host.measured_bandwidth and host.channels and host.measured_bandwidth > host.peak_bandwidth * 1.001:
        raise UsageError(
            f"--cpu {text}: bw={host.measured_bandwidth / 1e9:g} GB/s is above the channels' peak "
            f"({host.channels} x DDR-{host.mts}: {host.peak_bandwidth / 1e9:.1f} GB/s); check channels, mts and bw"
        )
    if host.numa > host.cores or (host.channels and host.numa > host.channels):
        raise UsageError(f"--cpu {text}: numa={host.numa}: more NUMA nodes than cores or memory channels")
    if one_line(host.name) != host.name or not host.name.strip():
        raise UsageError(f"--cpu {text!r}: name= must be printable and not empty")
    if ram_gib is not None and not host.ram_bytes:  # (a description's own ram= comes first, as --help says)
        host = replace(host, ram_bytes=ram_gib * 2**30)
    if host.ram_bytes <= 0:
        raise UsageError(f"--cpu {text}: how much RAM? give --ram GiB (or ram= in the description)")
    return host
