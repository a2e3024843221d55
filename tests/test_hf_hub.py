"""Hub ids (``bert-base-uncased``, ``org/name@rev``) wherever a checkpoint folder is read, through a
fake Hugging Face cache in tmp_path (the layout huggingface_hub writes); offline, no network."""

import pathlib
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from tacl_jax import analyze, hf, tokens
from tacl_jax.data import tokenization
from tacl_jax.errors import UserError
from tacl_jax.models import BertConfig, BertModel

TINY = dict(vocab_size=203, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=40, type_vocab_size=2)
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-bert"


def _tokenizer_json(path):
    """A BERT WordPiece tokenizer.json over TINY's 203 ids (specials first, as BERT's)."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(TINY["vocab_size"] - 5)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    tok.save(str(path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random BERT export (MLM head, tokenizer.json): the checkpoint both ways."""
    model = BertModel(BertConfig(**TINY, dtype="float32"))
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    tok_dir = tmp_path_factory.mktemp("tok")
    _tokenizer_json(tok_dir / "tokenizer.json")
    out = tmp_path_factory.mktemp("export") / "tiny"
    return hf.save(model, jax.tree.map(np.asarray, params), str(out), head="mlm", tokenizer_from=str(tok_dir))


def _hub_layout(cache, repo_id, src, commit=COMMIT, ref="main"):
    """``src`` laid out as huggingface_hub caches a snapshot: models--org--name/{refs/ref, snapshots/commit/}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return str(snap)


@pytest.fixture
def cache(tmp_path, monkeypatch, folder):
    """An offline Hugging Face cache (HF_HUB_CACHE) holding REPO at COMMIT (refs/main)."""
    root = tmp_path / "hub"
    _hub_layout(root, REPO, folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf._hub_snapshot.cache_clear()
    yield root
    hf._hub_snapshot.cache_clear()


def _equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", [REPO, f"{REPO}@main", f"{REPO}@{COMMIT}"])
def test_hub_id_loads_the_same_as_its_folder(cache, folder, name):
    snap = str(cache / "models--tiny-org--tiny-bert" / "snapshots" / COMMIT)
    assert hf.resolve(name) == snap
    m_id, p_id = hf.load(name, dtype="float32")
    m_dir, p_dir = hf.load(folder, dtype="float32")
    assert m_id.config == m_dir.config
    _equal_trees(p_id, p_dir)
    assert hf.read_config(name) == hf.read_config(folder)


def test_tokenizer_analysis_and_export_accept_a_hub_id(cache, folder, tmp_path):
    assert tokens.run_special_ids(REPO, TINY["vocab_size"]) == tokens.run_special_ids(folder, TINY["vocab_size"])
    assert (tokenization.vocab_fingerprint(tokenization.load_tokenizer(REPO))
            == tokenization.vocab_fingerprint(tokenization.load_tokenizer(folder)))
    entry = analyze.load_entry(REPO)
    assert entry.label == "tiny-bert" and entry.path == REPO
    assert entry.tokenizer_dir == hf.resolve(REPO)
    model, params = hf.load(folder, dtype="float32")
    out = hf.save(model, params, str(tmp_path / "out"), tokenizer_from=REPO)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (pathlib.Path(folder) / "tokenizer.json").read_bytes()
    assert out == str(tmp_path / "out")


def test_missing_hub_id_offline_names_the_id_the_cache_and_the_fix(cache):
    for read in (hf.load, hf.read_config, tokenization.load_tokenizer, analyze.load_entry):
        with pytest.raises(hf.FolderMissingError,
                           match=r"'nobody/absent-bert' is neither a local folder nor in the Hugging "
                                 r"Face cache at .*hub \(HF_HUB_OFFLINE is set\): run `hf download "
                                 r"nobody/absent-bert` on a machine with internet.*HF_HUB_CACHE.*local folder") as e:
            read("nobody/absent-bert")
        assert isinstance(e.value, UserError) and isinstance(e.value, FileNotFoundError)
        assert str(cache) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(hf.FolderMissingError, match=r"'tiny-org/tiny-bert@v2'.*`hf download tiny-org/tiny-bert "
                                                    r"--revision v2`"):
        hf.load(f"{REPO}@v2")   # a revision the cache does not have


@pytest.mark.parametrize("path", ["/no/such/bert-base-uncased", "./absent-bert", "~/absent-bert-xyz",
                                  "models/org/bert", "gs://bucket/bert", "", "bad--name", "a..b"])
def test_local_looking_path_is_a_missing_folder_not_a_hub_lookup(cache, monkeypatch, path):
    import huggingface_hub

    def no_hub(*a, **k):
        raise AssertionError(f"{path!r} looked up on the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    with pytest.raises(hf.FolderMissingError, match=r"folder .* does not exist; give a local folder .* or a Hub id"):
        hf.load(path)


def test_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(hf.FolderMissingError, match="is a file, not a Hugging Face checkpoint folder"):
        hf.read_config(str(tmp_path / "config.json"))


def test_online_fetches_only_what_is_read_once_per_process(tmp_path, monkeypatch, folder):
    """Online: snapshot_download into HF_HUB_CACHE with the config, tokenizer and safetensors
    patterns (pytorch_model.bin only when there are no safetensors), once per id."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hf._hub_snapshot.cache_clear()
    calls = []
    snap = _hub_layout(tmp_path / "hub", REPO, folder)
    torch_only = _hub_layout(tmp_path / "hub", "org/torch-only", folder)
    (tmp_path / "hub" / "models--org--torch-only" / "snapshots" / COMMIT / "model.safetensors").unlink()

    def fake(repo_id, **kw):
        calls.append((repo_id, kw))
        return snap if repo_id == REPO else torch_only

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert hf.resolve(REPO) == snap and hf.resolve(REPO) == snap
    assert len(calls) == 1
    kw = calls[0][1]
    assert kw["cache_dir"] == str(tmp_path / "hub") and kw["local_files_only"] is False and kw["revision"] is None
    assert {"config.json", "vocab.txt", "tokenizer.json", "model.safetensors",
            "model.safetensors.index.json"} <= set(kw["allow_patterns"])
    assert "pytorch_model.bin" not in kw["allow_patterns"]
    hf.resolve(f"{REPO}@v1", weights=False)
    assert calls[-1][1]["revision"] == "v1" and not any("model" in p for p in calls[-1][1]["allow_patterns"])
    hf.resolve("org/torch-only")
    assert [c[0] for c in calls[-2:]] == ["org/torch-only"] * 2
    assert "pytorch_model.bin" in calls[-1][1]["allow_patterns"]
    hf._hub_snapshot.cache_clear()


def test_unreachable_hub_without_cache_says_so(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants, errors

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hf._hub_snapshot.cache_clear()

    def unreachable(repo_id, **kw):
        raise errors.LocalEntryNotFoundError("no snapshot") from ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(hf.FolderMissingError, match=r"'bert-base-uncased' is neither a local folder nor in "
                                                    r"the Hugging Face cache at .*hub \(the Hub could not "
                                                    r"be reached: ConnectionError: Name or service not known\)"):
        hf.load("bert-base-uncased")
    hf._hub_snapshot.cache_clear()


def test_partly_cached_snapshot_says_so(cache, monkeypatch):
    """Offline, a snapshot downloaded without its weights (e.g. tokenizer only): the fix, not a
    missing-file error deep in the read."""
    import huggingface_hub

    errors = pytest.importorskip("huggingface_hub.errors")
    if not hasattr(errors, "IncompleteSnapshotError"):
        pytest.skip("this huggingface_hub has no partial-snapshot check")

    def partial(repo_id, **kw):
        raise errors.IncompleteSnapshotError("1 file(s) are missing (model.safetensors)", snapshot_path="x")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", partial)
    with pytest.raises(hf.FolderMissingError, match=r"'org/partial' is not a local folder and only partly in the "
                                                    r"Hugging Face cache at .* \(HF_HUB_OFFLINE is set\): run "
                                                    r"`hf download org/partial`"):
        hf.load("org/partial")


def test_local_folder_reads_the_cache_and_never_the_network(cache, folder, monkeypatch):
    """hf.local_folder: a folder or a cached id -> its folder; an uncached id -> None, with the
    network never tried even when online. tacl_jax.aot reads a cached id's architecture with it."""
    import huggingface_hub

    from tacl_jax import aot
    from tacl_jax.config import load_config_file

    snap = str(cache / "models--tiny-org--tiny-bert" / "snapshots" / COMMIT)
    assert hf.local_folder(folder) == folder and hf.local_folder(REPO) == snap
    hf._hub_snapshot.cache_clear()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    real = huggingface_hub.snapshot_download

    def cache_only(*args, **kwargs):
        assert kwargs.get("local_files_only") is True, "local_folder reached for the network"
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cache_only)
    assert hf.local_folder(REPO) == snap
    assert hf.local_folder("tiny-org/absent-bert") is None and hf.local_folder("/no/such/dir") is None
    root = pathlib.Path(__file__).resolve().parents[1]
    c = load_config_file(str(root / "configs" / "tiny.py"), {"init.hf_path": REPO, "init.from_scratch": False})
    arch, special, note = aot._architecture(c)
    assert arch == hf.read_config(folder) and special == tokens.run_special_ids(folder, arch.vocab_size)
    assert REPO in note and snap in note
