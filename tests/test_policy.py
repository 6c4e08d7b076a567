"""The decision, unit by unit: torch's signature, megatron-core's version, the mode.

torch 2.6, 2.7 and 2.8 cannot be installed side by side here, so their ``_write_item``
signatures come from the fakes in ``tests/fakes/fake_torch_write_items.py`` (real torch
2.13 is covered by the end-to-end tests). Every expected reason is written out in full:
the reason is what a user reads in ``status`` and in the log.
"""

import os
import sys
from typing import Optional, Tuple

import pytest
from fakes import fake_megatron_tree
from fakes import fake_torch_write_items as fake

import mcore_autopatch
from mcore_autopatch.fixes import write_item
from mcore_autopatch.shared import versions
from mcore_autopatch.shared.values import Decision
from mcore_autopatch.shared.writers import MEGATRON_CORE

UNKNOWN_SOURCE = "neither megatron-core's distribution metadata nor megatron.core.package_info gives a version"
MEGATRON_VERSIONS = ["0.8.0", "0.9.0", "0.11.0", "0.12.0", "0.12.3", "0.13.0", "0.13.1rc", "0.16.1", None]
TORCH_VERSIONS = {"2.6": "2.6.0", "2.7": "2.7.1", "2.8": "2.8.0"}
LEGACY = "stream, data, write_item, storage_key"


def megatron(version: Optional[str]) -> versions.WriterVersion:
    if version is None:
        return versions.WriterVersion(None, None, UNKNOWN_SOURCE)
    return versions.WriterVersion(version, versions.parse_release(version), "metadata")


def torch_has_all(name: str) -> bool:
    return True


def decide(generation: str, version: Optional[str], mode: str = "auto", has=torch_has_all) -> Decision:
    signature = write_item.read_signature(fake.FAKE_GENERATIONS[generation])
    return write_item.decide(mode, megatron(version), signature, TORCH_VERSIONS[generation], has)


def release_of(version: Optional[str]) -> Tuple[int, ...]:
    return tuple(int(part) for part in (version or "0.0").replace("rc", "").split(".")[:2])


# --- read_signature ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "function, generation, takes_transforms, has_format, format_required, format_index",
    [
        (fake.fake_torch_2_6_write_item, "torch<=2.6", False, False, False, None),
        (fake.fake_torch_2_7_write_item, "torch 2.7", True, False, False, None),
        (fake.fake_torch_2_8_write_item, "torch>=2.8", True, True, True, 5),
        (fake.fake_torch_future_default_torch_save, "torch>=2.8", True, True, False, 5),
        (fake.fake_torch_future_default_safetensors, "torch>=2.8", True, True, False, 5),
        (fake.fake_torch_future_keyword_only, "torch>=2.8", True, True, True, None),
    ],
    ids=["2.6", "2.7", "2.8", "default-torch-save", "default-safetensors", "keyword-only"],
)
def test_known_signature_is_classified_by_parameter_names(
    function, generation, takes_transforms, has_format, format_required, format_index
):
    """Each generation is told apart by its parameters, never by torch's version string."""
    sig = write_item.read_signature(function)
    assert sig.problem is None
    assert sig.generation == generation
    assert (sig.takes_transforms, sig.has_format, sig.format_required, sig.format_index) == (
        takes_transforms,
        has_format,
        format_required,
        format_index,
    )


def test_torch_2_7_signature_reads_safe_tensors_as_optional_and_never_as_the_format():
    """2.7's 6th parameter is safe_tensors: it must not be mistaken for serialization_format."""
    sig = write_item.read_signature(fake.fake_torch_2_7_write_item)
    assert sig.text == "_write_item(transforms, %s, safe_tensors=False)" % LEGACY
    assert sig.has_format is False
    assert sig.format_index is None


def test_signature_defaults_are_kept_for_the_decision():
    assert write_item.read_signature(fake.fake_torch_future_default_torch_save).format_default is (
        fake.FakeSerializationFormat.TORCH_SAVE
    )
    assert write_item.read_signature(fake.fake_torch_future_default_safetensors).format_default is (
        fake.FakeSerializationFormat.SAFETENSORS
    )


def test_renamed_required_parameter_is_a_problem_with_its_name():
    """A torch whose 6th required parameter has another name: its needs are unknown."""
    sig = write_item.read_signature(fake.fake_torch_future_renamed)
    assert sig.generation == "unrecognised"
    assert sig.problem == (
        "_write_item(transforms, %s, save_format) has a required parameter 'save_format' "
        "that mcore-autopatch does not know" % LEGACY
    )


def test_varargs_signature_is_a_problem():
    """``(*args, **kwargs)`` says nothing about what torch needs: never guess."""
    sig = write_item.read_signature(fake.fake_torch_future_varargs)
    assert sig.generation == "unrecognised"
    assert sig.problem == "_write_item(*args, **kwargs) takes *args or **kwargs; its needs cannot be read"


def test_signature_text_shows_keyword_only_and_defaults_without_annotations():
    """The text is what status prints: the parameters as declared, annotations left out."""

    def fake_torch_annotated_write_item(
        transforms: object,
        stream: object,
        data: object,
        write_item: object,
        storage_key: str,
        *,
        serialization_format: str = "torch_save",
    ) -> None:
        pass

    assert write_item.read_signature(fake.fake_torch_future_keyword_only).text == (
        "_write_item(transforms, %s, *, serialization_format)" % LEGACY
    )
    assert write_item.read_signature(fake_torch_annotated_write_item).text == (
        "_write_item(transforms, %s, *, serialization_format='torch_save')" % LEGACY
    )


def test_signature_with_unfamiliar_head_is_a_problem():
    def fake_torch_reordered_write_item(stream, transforms, data, write_item, storage_key):
        pass

    sig = write_item.read_signature(fake_torch_reordered_write_item)
    assert sig.problem == (
        "_write_item(stream, transforms, data, write_item, storage_key) does not start with the parameters "
        "megatron-core passes"
    )


def test_unreadable_signature_is_a_problem():
    """A callable whose signature inspect cannot read is not classified."""

    def fake_torch_unreadable_write_item(*args):
        pass

    fake_torch_unreadable_write_item.__signature__ = "not a Signature"  # inspect raises TypeError
    sig = write_item.read_signature(fake_torch_unreadable_write_item)
    assert sig.generation == "unrecognised"
    assert sig.problem is not None and sig.problem.startswith("cannot read the signature of _write_item: ")


# --- decide: every generation x megatron-core release x mode ----------------------------


@pytest.mark.parametrize("mode", ["auto", "force"])
@pytest.mark.parametrize("version", MEGATRON_VERSIONS)
def test_torch_2_6_nothing_needed_for_any_release(version, mode):
    """torch <= 2.6 takes exactly the four arguments every megatron-core release passes."""
    d = decide("2.6", version, mode)
    assert d.needed is False
    assert d.plan is None
    assert d.reason == "torch 2.6.0's _write_item(%s) is called correctly by every megatron-core release" % LEGACY


@pytest.mark.parametrize("version", MEGATRON_VERSIONS)
def test_torch_2_7_auto_supplies_transforms_only_before_0_12(version):
    """2.7 + 0.9-0.11: transforms only (never a 6th argument); 0.12+: nothing."""
    d = decide("2.7", version)
    if version is None:
        assert (d.needed, d.plan) == (None, None)
        assert d.reason == UNKNOWN_SOURCE + "; set MCORE_AUTOPATCH=force to patch anyway"
    elif release_of(version) >= (0, 13):
        assert (d.needed, d.plan) == (False, None)
        assert d.reason == "megatron-core %s passes serialization_format itself" % version
    elif release_of(version) >= (0, 12):
        assert (d.needed, d.plan) == (False, None)
        assert d.reason == "megatron-core %s passes everything torch 2.7.1's _write_item requires" % version
    else:
        assert d.needed is True
        assert d.plan == write_item.Plan(add_transforms=True, add_format=False)
        assert d.reason == "megatron-core %s calls _write_item without transforms; torch 2.7.1 requires it" % version


@pytest.mark.parametrize("version", MEGATRON_VERSIONS)
def test_torch_2_8_auto_supplies_what_each_release_lacks(version):
    """2.8 + 0.12.x: serialization_format only; 2.8 + 0.9-0.11: both; 0.13+: nothing."""
    d = decide("2.8", version)
    if version is None:
        assert (d.needed, d.plan) == (None, None)
        assert d.reason == UNKNOWN_SOURCE + "; set MCORE_AUTOPATCH=force to patch anyway"
    elif release_of(version) >= (0, 13):
        assert (d.needed, d.plan) == (False, None)
        assert d.reason == "megatron-core %s passes serialization_format itself" % version
    elif release_of(version) >= (0, 12):
        assert d.needed is True
        assert d.plan == write_item.Plan(add_transforms=False, add_format=True)
        assert d.reason == (
            "megatron-core %s calls _write_item without serialization_format; torch 2.8.0 requires it" % version
        )
    else:
        assert d.needed is True
        assert d.plan == write_item.Plan(add_transforms=True, add_format=True)
        assert d.reason == (
            "megatron-core %s calls _write_item without transforms and serialization_format; "
            "torch 2.8.0 requires them" % version
        )


@pytest.mark.parametrize("version", MEGATRON_VERSIONS)
def test_torch_2_7_force_supplies_transforms_for_every_release(version):
    """force skips the version gate; the per-call check leaves complete calls alone."""
    d = decide("2.7", version, "force")
    assert d.needed is True
    assert d.plan == write_item.Plan(add_transforms=True, add_format=False)
    assert d.reason == "MCORE_AUTOPATCH=force: supplying transforms where a call lacks it (megatron-core %s)" % (
        version or "(unknown version)"
    )


@pytest.mark.parametrize("version", MEGATRON_VERSIONS)
def test_torch_2_8_force_supplies_both_for_every_release(version):
    d = decide("2.8", version, "force")
    assert d.needed is True
    assert d.plan == write_item.Plan(add_transforms=True, add_format=True)
    assert d.reason == (
        "MCORE_AUTOPATCH=force: supplying transforms and serialization_format where a call lacks it "
        "(megatron-core %s)" % (version or "(unknown version)")
    )


@pytest.mark.parametrize(
    "missing, version, reason_end",
    [
        ("SerializationFormat", "0.12.1", "but torch has no SerializationFormat to supply; not patching"),
        ("_StorageWriterTransforms", "0.9.0", "but torch has no _StorageWriterTransforms to supply; not patching"),
    ],
)
def test_torch_without_what_is_needed_is_not_patched_with_reason(missing, version, reason_end):
    """Needed, but the object to supply is gone from torch: say so, patch nothing."""
    d = decide("2.8", version, has=lambda name: name != missing)
    assert d.needed is True
    assert d.plan is None
    assert d.reason.startswith("megatron-core %s calls _write_item without" % version)
    assert d.reason.endswith(", " + reason_end)


def test_torch_without_transforms_class_still_supplies_format_for_0_12():
    """0.12 passes its own transforms, so a missing _StorageWriterTransforms does not matter."""
    d = decide("2.8", "0.12.1", has=lambda name: name != "_StorageWriterTransforms")
    assert d.plan == write_item.Plan(add_transforms=False, add_format=True)


def test_force_with_nothing_to_supply_is_not_patched():
    """force on torch 2.7 without _StorageWriterTransforms has nothing it could add."""
    d = decide("2.7", "0.9.0", "force", has=lambda name: False)
    assert (d.needed, d.plan) == (None, None)
    assert d.reason == "MCORE_AUTOPATCH=force, but torch has nothing to supply; not patching"


# --- decide: plausible future torch signatures -------------------------------------------


def decide_future(function, version: Optional[str], mode: str = "auto") -> Decision:
    return write_item.decide(mode, megatron(version), write_item.read_signature(function), "2.99.0", torch_has_all)


def test_future_format_default_torch_save_needs_no_format():
    """A TORCH_SAVE default writes the tensor bytes already: 0.12 needs nothing."""
    d = decide_future(fake.fake_torch_future_default_torch_save, "0.12.1")
    assert (d.needed, d.plan) == (False, None)
    assert d.reason == "megatron-core 0.12.1 passes everything torch 2.99.0's _write_item requires"


def test_future_format_default_torch_save_still_needs_transforms_before_0_12():
    d = decide_future(fake.fake_torch_future_default_torch_save, "0.9.0")
    assert d.plan == write_item.Plan(add_transforms=True, add_format=False)


def test_future_format_default_safetensors_must_supply_torch_save():
    """SAFETENSORS writes no tensor bytes inside _write_item: TORCH_SAVE must be passed."""
    d = decide_future(fake.fake_torch_future_default_safetensors, "0.12.1")
    assert d.needed is True
    assert d.plan == write_item.Plan(add_transforms=False, add_format=True)


def test_future_keyword_only_format_is_supplied():
    d = decide_future(fake.fake_torch_future_keyword_only, "0.12.1")
    assert d.plan == write_item.Plan(add_transforms=False, add_format=True)


@pytest.mark.parametrize("mode", ["auto", "force"])
@pytest.mark.parametrize("function", [fake.fake_torch_future_renamed, fake.fake_torch_future_varargs])
def test_future_unknown_signature_not_patched_even_with_force(function, mode):
    """Neither auto nor force guesses at a signature it does not know."""
    d = decide_future(function, "0.12.1", mode)
    assert (d.needed, d.plan) == (None, None)
    sig = write_item.read_signature(function)
    assert d.reason == "torch 2.99.0: %s; not patching" % sig.problem


# --- megatron-core's version --------------------------------------------------------------

RELEASES = [
    ("0.12.1", (0, 12, 1)),
    ("0.13.1rc", (0, 13, 1)),
    ("0.13.0rc0", (0, 13, 0)),
    ("0.12", (0, 12)),
    ("v0.12.3", (0, 12, 3)),
    ("0.12.1+nv25.3", (0, 12, 1)),
    ("  0.9.0", (0, 9, 0)),
    ("not-a-version", None),
    ("", None),
    (None, None),
    (12, None),
]


@pytest.mark.parametrize("text, release", RELEASES)
def test_parse_release_with_packaging(text, release):
    pytest.importorskip("packaging")
    assert versions.parse_release(text) == release


@pytest.mark.parametrize("text, release", RELEASES)
def test_parse_release_without_packaging_reads_plain_versions(monkeypatch, text, release):
    """A broken environment without packaging still reads X.Y[.Z] (the fix is not lost)."""
    monkeypatch.setitem(sys.modules, "packaging", None)  # None in sys.modules: import fails
    monkeypatch.setitem(sys.modules, "packaging.version", None)
    with pytest.raises(ImportError):
        import packaging.version  # noqa: F401
    assert versions.parse_release(text) == release


def test_parse_release_without_packaging_is_more_lenient(monkeypatch):
    """Documented difference: the fallback reads a leading X.Y.Z that PEP 440 rejects."""
    pytest.importorskip("packaging")
    assert versions.parse_release("0.12.1-custom-build") is None
    monkeypatch.setitem(sys.modules, "packaging", None)
    monkeypatch.setitem(sys.modules, "packaging.version", None)
    assert versions.parse_release("0.12.1-custom-build") == (0, 12, 1)


@pytest.fixture
def fake_megatron_on_path(monkeypatch, tmp_path):
    """Put a FAKE megatron-core tree first on sys.path; forget every megatron module after."""

    def put(**variation) -> str:
        folder = fake_megatron_tree(str(tmp_path / ("fake-megatron-%d" % len(os.listdir(tmp_path)))), **variation)
        monkeypatch.syspath_prepend(folder)
        return folder

    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    yield put
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        del sys.modules[name]


def test_megatron_version_from_its_metadata(fake_megatron_on_path):
    fake_megatron_on_path(version="0.12.1")
    mv = versions.writer_version(MEGATRON_CORE)
    assert (mv.version, mv.release, mv.source) == ("0.12.1", (0, 12, 1), "metadata")


def test_megatron_metadata_without_version_falls_back_to_package_info(fake_megatron_on_path):
    from fakes import fake_metadata

    fake_megatron_on_path(version="0.11.0", metadata=fake_metadata(None))
    mv = versions.writer_version(MEGATRON_CORE)
    assert (mv.version, mv.release, mv.source) == ("0.11.0", (0, 11, 0), "package_info")


def test_megatron_invalid_metadata_version_falls_back_to_package_info(fake_megatron_on_path):
    from fakes import fake_metadata

    fake_megatron_on_path(version="0.12.2", metadata=fake_metadata("not-a-version"))
    mv = versions.writer_version(MEGATRON_CORE)
    assert (mv.version, mv.source) == ("0.12.2", "package_info")


def test_megatron_without_metadata_or_package_info_is_unknown(fake_megatron_on_path):
    fake_megatron_on_path(metadata=None, package_info=False)
    mv = versions.writer_version(MEGATRON_CORE)
    assert mv.known is False
    assert (mv.version, mv.source) == (None, UNKNOWN_SOURCE)


def test_megatron_metadata_of_another_copy_loses_to_the_imported_package_info(fake_megatron_on_path):
    """Metadata of a shadowed copy must not decide for the code actually imported."""
    fake_megatron_on_path(version="0.13.1", package_info=False)  # behind: metadata only
    fake_megatron_on_path(version="0.12.1", metadata=None)  # first on sys.path: the imported code
    import megatron.core  # noqa: F401  (the comparison needs the imported package)

    mv = versions.writer_version(MEGATRON_CORE)
    assert (mv.version, mv.source) == ("0.12.1", "package_info")


# --- MCORE_AUTOPATCH ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        (None, ("auto", True)),
        ("", ("auto", True)),
        ("   ", ("auto", True)),
        ("auto", ("auto", True)),
        (" AUTO\t", ("auto", True)),
        ("0", ("off", True)),
        (" 0 ", ("off", True)),
        ("OFF", ("off", True)),
        ("off\n", ("off", True)),
        ("False", ("off", True)),
        ("no", ("off", True)),
        ("force", ("force", True)),
        (" Force ", ("force", True)),
        ("1", ("auto", False)),
        ("on", ("auto", False)),
        ("enable", ("auto", False)),
        ("forced", ("auto", False)),
        ("0ff", ("auto", False)),
        ("\uff4f\uff46\uff46", ("auto", False)),  # fullwidth "off": not the ASCII word
        ("désactivé", ("auto", False)),
        ("\u00a0off\u00a0", ("off", True)),  # str.strip() removes Unicode whitespace too
    ],
)
def test_read_mode_odd_value(raw, expected):
    """Only the documented words switch; anything else is auto, flagged as unrecognised."""
    environ = {} if raw is None else {"MCORE_AUTOPATCH": raw}
    assert mcore_autopatch.read_mode(environ) == expected


def test_read_mode_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("MCORE_AUTOPATCH", " Off ")
    assert mcore_autopatch.read_mode() == ("off", True)
    monkeypatch.delenv("MCORE_AUTOPATCH")
    assert mcore_autopatch.read_mode() == ("auto", True)
