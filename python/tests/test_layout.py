"""The ctypes structures and constants agree with what a C compiler makes of mla.h.

The C side is layout_helper.c: ctest builds it (MLA_LAYOUT_HELPER names the
program); run by hand, the test compiles it with $CC / cc, and is skipped
only when no C compiler is found. A second check reads the field names of
each struct straight from the header, so a field added to mla.h but to
neither the helper nor the binding still fails.
"""

import ctypes
import os
import re
import shutil
import subprocess

import pytest

import libmla
from libmla import _lib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HEADER = os.path.join(ROOT, "include", "mla.h")


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    exe = os.environ.get("MLA_LAYOUT_HELPER")
    if not exe:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if not cc:
            pytest.skip("skipped: no C compiler to build layout_helper.c (set MLA_LAYOUT_HELPER)")
        exe = str(tmp_path_factory.mktemp("layout") / "layout_helper")
        subprocess.run([cc, "-std=c11", "-I", os.path.join(ROOT, "include"),
                        os.path.join(HERE, "layout_helper.c"), "-o", exe], check=True)
    out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    structs, fields, consts, enums = {}, {}, {}, {}
    for line in out.splitlines():
        p = line.split()
        if p[0] == "struct":
            structs[p[1]] = int(p[2])
        elif p[0] == "field":
            fields.setdefault(p[1], []).append((p[2], int(p[3]), int(p[4])))
        elif p[0] == "const":
            consts[p[1]] = int(p[2])
        elif p[0] == "enum":
            enums[p[1]] = int(p[2])
    return structs, fields, consts, enums


def test_struct_sizes_and_offsets(c_layout):
    structs, fields, _, _ = c_layout
    assert set(structs) == set(_lib.STRUCTS), "structs in the helper vs the binding"
    for name, cls in _lib.STRUCTS.items():
        assert ctypes.sizeof(cls) == structs[name], "sizeof(%s): ctypes %d, C %d" % (
            name, ctypes.sizeof(cls), structs[name])
        py = [(f[0], getattr(cls, f[0]).offset, getattr(cls, f[0]).size) for f in cls._fields_]
        assert py == fields[name], "%s fields (name, offset, size):\nctypes %s\nC      %s" % (
            name, py, fields[name])


def test_enums_are_int_sized(c_layout):
    _, _, _, enums = c_layout
    for name, size in enums.items():
        assert size == ctypes.sizeof(ctypes.c_int), "%s is %d bytes" % (name, size)


def test_constants(c_layout):
    _, _, consts, _ = c_layout
    expect = {
        "MLA_VERSION_MAJOR": _lib.VERSION_MAJOR, "MLA_VERSION_MINOR": _lib.VERSION_MINOR,
        "MLA_LATENT": libmla.LATENT, "MLA_ROPE": libmla.ROPE, "MLA_ROW": libmla.ROW,
        "MLA_FP8_BLOCK": libmla.FP8_BLOCK, "MLA_FP8_BLOCK_ROW_BYTES": libmla.FP8_BLOCK_ROW_BYTES,
        "MLA_MAX_PAGE_SIZE": libmla.MAX_PAGE_SIZE, "MLA_MAX_HEADS": libmla.MAX_HEADS,
        "MLA_MAX_HEAD_DIM": libmla.MAX_HEAD_DIM, "MLA_BLOCK_TABLE_PAD": libmla.BLOCK_TABLE_PAD,
        "MLA_SLOT_UNUSED": libmla.SLOT_UNUSED, "MLA_REQ_PAD": libmla.REQ_PAD,
        "MLA_SCHED_BLOCK": _lib.SCHED_BLOCK, "MLA_SCHED_FIXED_OVERHEAD": _lib.SCHED_FIXED_OVERHEAD,
        "MLA_SCHED_NOCUT_DIV": _lib.SCHED_NOCUT_DIV,
        "MLA_SCHED_META_INTS": _lib.SCHED_META_INTS, "MLA_FLAG_LSE_BASE2": libmla.FLAG_LSE_BASE2,
        "MLA_FLAG_OUT_F32": libmla.FLAG_OUT_F32, "MLA_FLAG_FP8_MATH": libmla.FLAG_FP8_MATH,
        "MLA_OK": libmla.Status.OK,
    }
    for s in libmla.Status:
        if s != libmla.Status.OK:
            expect["MLA_" + s.name] = s.value
    for e, prefix in ((libmla.DType, "MLA_DTYPE_"), (libmla.Device, "MLA_DEVICE_"),
                      (libmla.Mode, "MLA_MODE_"), (libmla.ExtendImpl, "MLA_EXTEND_"),
                      (libmla.Sched, "MLA_SCHED_")):
        for m in e:
            expect[prefix + m.name] = m.value
    missing = set(expect) - set(consts)
    assert not missing, "the helper does not print %s" % sorted(missing)
    for k, v in expect.items():
        assert consts[k] == v, "%s: C %d, binding %d" % (k, consts[k], v)


def _header_structs():
    """Field names of every `typedef struct NAME { ... } NAME;` in mla.h, in order."""
    text = open(HEADER).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out = {}
    for m in re.finditer(r"typedef struct (\w+) \{(.*?)\} (\w+);", text, flags=re.S):
        names = []
        for decl in m.group(2).split(";"):
            decl = decl.strip()
            if not decl:
                continue
            # "int32_t rank, world" declares two fields; a pointer's * belongs to the type.
            head, *rest = [d.strip() for d in decl.split(",")]
            names.append(re.findall(r"(\w+)\s*(?:\[[^\]]*\])?$", head)[0])
            names += [re.sub(r"[*\s]", "", r) for r in rest]
        out[m.group(3)] = names
    return out


def test_header_fields_match_binding():
    hs = _header_structs()
    assert set(hs) == set(_lib.STRUCTS), "structs in mla.h %s vs binding %s" % (
        sorted(hs), sorted(_lib.STRUCTS))
    for name, cls in _lib.STRUCTS.items():
        assert [f[0] for f in cls._fields_] == hs[name], "%s: mla.h %s, binding %s" % (
            name, hs[name], [f[0] for f in cls._fields_])


def test_every_prototype_is_in_the_header():
    text = open(HEADER).read()
    declared = set(re.findall(r"MLA_API[^;]*?\b(mla_\w+)\s*\(", text))
    bound = set(_lib.PROTOTYPES)
    assert bound <= declared, "bound but not declared: %s" % sorted(bound - declared)
    assert declared <= bound, "declared in mla.h but not bound: %s" % sorted(declared - bound)
    assert not _lib.missing_functions, "the library lacks %s" % (_lib.missing_functions,)
