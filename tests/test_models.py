"""Model loading: embedded alias, local paths, store names, hub ids offline, non-encoders; eager attention."""
import json

import pytest
import torch
from transformers import BertModel, GPT2Config, GPT2Model

from analysis.data import Example
from analysis.errors import AttnpatError
from analysis.models import load_model, model_slug, resolve_model
from analysis.stream import stream_maps
from tests.tiny import minilm_tokenizer, save_tiny_model


def test_embedded_minilm_loads_offline_with_attentions(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bundle = load_model("minilm")
    assert (bundle.num_layers, bundle.num_heads) == (6, 12)
    assert bundle.source.kind == "embedded" and bundle.config.model_type == "bert"
    assert bundle.model.config._attn_implementation == "eager"
    batch = next(iter(stream_maps(bundle, [Example("x", "attention maps are never empty .")])))
    assert batch.attentions.shape[1:3] == (6, 12) and batch.attentions.abs().sum() > 0
    assert len(bundle.revision) == 16 and load_model("minilm").revision == bundle.revision


def test_local_path_and_store_name(tmp_path, monkeypatch):
    save_tiny_model(tmp_path / "models" / "tiny-store")
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    (tmp_path / "models" / "tiny-store" / "attnpat.json").write_text(json.dumps({"task": "sst2"}))
    stored = load_model("tiny-store", device="cpu")
    assert stored.source.kind == "store" and stored.meta == {"task": "sst2"} and stored.num_layers == 2
    local = load_model(str(tmp_path / "models" / "tiny-store"), device="cpu")
    assert local.source.kind == "local" and model_slug(local.name) == "tiny-store"


def test_hub_id_offline_names_the_working_alias(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AttnpatError, match="could not load model 'bert-base-uncased'.*--model minilm"):
        load_model("bert-base-uncased")


def test_non_encoders_and_bad_paths_are_refused(tmp_path):
    GPT2Model(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(AttnpatError, match="is a gpt2 model, not a BERT-family encoder"):
        load_model(str(tmp_path / "gpt2"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AttnpatError, match="without config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(AttnpatError, match="does not exist"):
        resolve_model("./no/such/model")
    with pytest.raises(AttnpatError, match="empty model name"):
        resolve_model("  ")


def test_mlm_kind_without_an_mlm_head_is_a_clear_error():
    with pytest.raises(AttnpatError, match="no masked-language-model head"):
        load_model("minilm", kind="mlm")


def test_classifier_kind_gets_a_fresh_head_of_the_requested_size(tmp_path):
    save_tiny_model(tmp_path / "tiny")
    bundle = load_model(str(tmp_path / "tiny"), kind="classifier", num_labels=3, device="cpu")
    out = bundle.model(input_ids=torch.tensor([[101, 2000, 102]]))
    assert out.logits.shape == (1, 3)


def test_model_slugs_are_file_system_safe():
    assert model_slug("google/electra-small-discriminator") == "google__electra-small-discriminator"
    assert model_slug("/abs/path/my-model") == "my-model"


def test_a_name_too_long_for_a_file_name_is_one_error_line():
    """With --allow-any-model the web app passes any name: 400 characters was "unexpected error: OSError: [Errno
    36] File name too long" with a traceback in the log."""
    with pytest.raises(AttnpatError, match=r"^could not look for model 'a{80}\.\.\.' \(file name too long\)$"):
        resolve_model("a" * 400)
    with pytest.raises(AttnpatError, match="could not look for model"):
        load_model("./" + "b" * 300)


@pytest.mark.parametrize("kind", ["bert", "mpnet"])
def test_max_length_is_bounded_by_the_models_position_table(tmp_path, kind):
    """A tokenizer whose recorded maximum exceeds the model's position table (or that records none) no longer lets
    --max-length past it: one error line instead of a tensor-size traceback mid-run."""
    from tests.tiny import MPNET_CLASSES, mpnet_tokenizer, tiny_config, tiny_mpnet_config  # noqa: PLC0415

    if kind == "bert":
        config, model_class, tokenizer, usable = tiny_config(), BertModel, minilm_tokenizer(), 40
        config.max_position_embeddings = 40
    else:  # positions start after the padding id: 42 - (1 + 1) usable
        config, model_class, tokenizer, usable = tiny_mpnet_config(), MPNET_CLASSES["base"], mpnet_tokenizer(), 40
        config.max_position_embeddings = 42
    model_class(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    bundle = load_model(str(tmp_path))
    assert bundle.tokenizer.model_max_length == usable
    long_text = [Example("long", " ".join(["word"] * 100))]
    with pytest.raises(AttnpatError, match=f"maximum length 128 exceeds the model's limit of {usable} tokens"):
        list(stream_maps(bundle, long_text, max_length=128))
    (maps,) = [item for batch in stream_maps(bundle, long_text, max_length=usable) for item in [batch]]
    assert maps.attentions.shape[-1] == usable


def test_a_model_without_token_types_gets_none_from_a_bert_tokenizer(tmp_path, monkeypatch, capsys):
    """A RoBERTa-architecture model shipped with a BERT tokenizer (as klue/roberta-base is) has one token type; the
    tokenizer gives a pair's second segment type 1. Before: every verb on a pair task (rte, mrpc) died with
    `IndexError: index out of range in self` from the token-type embedding. Now it gets no token_type_ids (zeros,
    what it was trained with); a BERT keeps its segment ids."""
    from transformers import RobertaConfig, RobertaForMaskedLM  # noqa: PLC0415

    from app.cli import main  # noqa: PLC0415
    from tests.tiny import tiny_config  # noqa: PLC0415

    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    tokenizer = minilm_tokenizer()
    config = RobertaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=37, max_position_embeddings=514, pad_token_id=0, type_vocab_size=1,
                           attn_implementation="eager")
    torch.manual_seed(0)
    RobertaForMaskedLM(config).save_pretrained(tmp_path / "models" / "roberta-bert-vocab")
    tokenizer.save_pretrained(tmp_path / "models" / "roberta-bert-vocab")
    BertModel(tiny_config()).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    pair = Example("pair", "a fine movie .", "it was truly bad !")

    roberta = load_model("roberta-bert-vocab", device="cpu")
    (batch,) = stream_maps(roberta, [pair])
    assert batch.batch.token_type_ids is None
    direct = roberta.tokenizer(pair.text, pair.text_pair, return_tensors="pt")
    assert set(direct) == {"input_ids", "attention_mask"}
    with torch.no_grad():
        expected = torch.stack(roberta.model(**direct, output_attentions=True).attentions, dim=1)
    torch.testing.assert_close(batch.attentions, expected, atol=1e-6, rtol=1e-5)
    bert = load_model(str(tmp_path / "bert"), device="cpu")
    (bert_batch,) = stream_maps(bert, [pair])
    assert bert_batch.batch.token_type_ids is not None and int(bert_batch.batch.token_type_ids.max()) == 1

    common = ["--model", "roberta-bert-vocab", "--task", "rte", "--n", "4", "--runs-dir", str(tmp_path / "runs"), "-q"]
    for verb in (["overview"], ["special", "--no-base"], ["surface", "--map-kind", "rollout"], ["grad-importance"]):
        assert main([*verb, *common]) == 0, (verb, capsys.readouterr().err)
