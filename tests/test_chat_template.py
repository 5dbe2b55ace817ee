"""data.chat_template: a supplied template (file or inline) gives assistant-only masks on a base tokenizer without one;
bad templates and bad paths fail early, naming the fix."""
import pytest
from specdistill.config import Config, DataConfig, TargetConfig

from specdistill.data.chat import resolve_chat_template, set_chat_template, tokenize_conversation
from specdistill.validation import path_errors
from tests.conftest import CHATML, make_tokenizer

CONV = [{"role": "user", "content": "hello what is the color"}, {"role": "assistant", "content": "the cat is red"},
        {"role": "user", "content": "why"}, {"role": "assistant", "content": "one two three dog"}]


@pytest.fixture(scope="module")
def base_tokenizer():
    tok = make_tokenizer()
    tok.chat_template = None  # a base model: no template of its own
    return tok


def _fresh(base):
    import copy

    return copy.deepcopy(base)


def _masked_text(tok, t):
    """(text of the tokens that carry loss, text of the others): loss_mask[i] marks token i+1."""
    ids = t.input_ids
    trained = [ids[i + 1] for i in range(len(ids) - 1) if t.loss_mask[i]]
    rest = [ids[0]] + [ids[i + 1] for i in range(len(ids) - 1) if not t.loss_mask[i]]
    return tok.decode(trained), tok.decode(rest)


def test_base_tokenizer_without_template_is_refused_with_the_setting_named(base_tokenizer):
    with pytest.raises(ValueError, match="data.chat_template"):
        tokenize_conversation(base_tokenizer, CONV, 128)


@pytest.mark.parametrize("as_file", [False, True])
def test_supplied_template_masks_exactly_the_assistant_turns(base_tokenizer, tmp_path, as_file):
    tok = _fresh(base_tokenizer)
    value = CHATML
    if as_file:
        (tmp_path / "chatml.jinja").write_text(CHATML)
        value = str(tmp_path / "chatml.jinja")
    set_chat_template(tok, value)
    t = tokenize_conversation(tok, CONV, 512)
    trained, rest = _masked_text(tok, t)
    # The assistant turns, each through its end-of-turn marker (what the model must emit), and nothing else.
    assert trained == "the cat is red<|im_end|>\none two three dog<|im_end|>\n"
    assert "red" not in rest and "dog" not in rest and "hello" in rest and "<|im_start|>assistant\n" in rest
    assert len(t.input_ids) == len(t.loss_mask) and t.loss_mask[-1] == 0


def test_plain_template_without_headers_or_generation_prompt_is_accepted(base_tokenizer):
    tok = _fresh(base_tokenizer)
    set_chat_template(tok, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    trained, rest = _masked_text(tok, tokenize_conversation(tok, CONV, 512))
    assert trained == "the cat is red\none two three dog\n" and "hello" in rest


def test_template_that_never_renders_the_answer_is_refused(base_tokenizer):
    tok = _fresh(base_tokenizer)
    users_only = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="never renders the assistant's text"):
        set_chat_template(tok, users_only)


def test_template_ignoring_generation_prompt_names_the_fix(base_tokenizer):
    tok = _fresh(base_tokenizer)
    no_gen = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ValueError, match="add_generation_prompt .*<\\|im_start\\|>assistant"):
        set_chat_template(tok, no_gen)


def test_template_that_fails_to_render_is_refused(base_tokenizer):
    tok = _fresh(base_tokenizer)
    with pytest.raises(ValueError, match="fails to render"):
        set_chat_template(tok, "{{ raise_exception('no system role') }}")


def test_missing_file_that_is_no_template_fails_in_config_validation(tmp_path):
    with pytest.raises(ValueError, match="neither an existing file nor a Jinja template"):
        resolve_chat_template(str(tmp_path / "nope.jinja"))
    cfg = Config(target=TargetConfig(path="embedded:x"),
                 data=DataConfig(path="embedded:sharegpt", chat_template="./templates/chatml.jinja"))
    errs = path_errors(cfg)
    assert any("data.chat_template" in e for e in errs)
    (tmp_path / "empty.txt").write_text("just text")
    with pytest.raises(ValueError, match="holds no Jinja template"):
        resolve_chat_template(str(tmp_path / "empty.txt"))


def test_build_tokenizer_installs_the_setting(base_tokenizer, tmp_path):
    from specdistill.build import build_tokenizer

    base_tokenizer.save_pretrained(tmp_path / "base")  # a model folder whose tokenizer has no template
    (tmp_path / "base" / "config.json").write_text("{}")
    cfg = Config(target=TargetConfig(path=str(tmp_path / "base")), data=DataConfig(chat_template=CHATML))
    tok = build_tokenizer(cfg)
    assert tok.chat_template == CHATML
    trained, _ = _masked_text(tok, tokenize_conversation(tok, CONV, 512))
    assert trained.startswith("the cat is red<|im_end|>")
