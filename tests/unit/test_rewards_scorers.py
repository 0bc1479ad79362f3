"""The built-in scorers (gsm8k, math, arithmetic), their answer extraction, and the routing by data_source."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fixtures import make_tokenizer, rl_row

from ember.data.parquet import write_parquet
from ember.data.rl_dataset import RLDataset
from ember.rewards import RewardItem, arithmetic, gsm8k, resolve_reward_fn
from ember.rewards import math as math_reward
from ember.rewards import math_dapo
from ember.rewards.contract import RewardConfigError
from ember.rewards.extraction import (
    last_answer_line,
    last_boxed_content,
    last_marked_answer,
    last_number,
    normalize_number,
)
from ember.rewards.routing import default_compute_score


@pytest.mark.parametrize(
    "written, expected",
    [
        ("1,234", "1234"),
        ("$1,234", "1234"),
        ("\\$18", "18"),
        ("  42  ", "42"),
        ("42.", "42"),
        ("18.0", "18"),
        ("18.00", "18"),
        ("18.50", "18.5"),
        ("-7", "-7"),
        ("-$5", "-5"),
        ("1{,}000", "1000"),
        ("-0.0", "0"),
        ("x+1", "x+1"),
    ],
)
def test_normalize_number(written, expected):
    assert normalize_number(written) == expected


def test_last_boxed_content_balances_braces_and_takes_the_last_box():
    assert last_boxed_content("first \\boxed{1}, then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed_content("\\fbox{7} is it") == "7"
    assert last_boxed_content("\\boxed{3} then \\fbox{4}") == "4"
    assert last_boxed_content("so $\\boxed 5$") == "5"
    assert last_boxed_content("cut off \\boxed{\\frac{1}{2}") is None
    assert last_boxed_content("empty \\boxed{ }") is None
    assert last_boxed_content("no box here") is None
    assert last_boxed_content("a box left unfinished: \\boxed") is None  # neither braces nor a bare answer


def test_last_marked_answer_takes_whichever_marker_comes_last():
    assert last_marked_answer("#### 5 and later \\boxed{6}") == "6"
    assert last_marked_answer("\\boxed{6} and later #### 5") == "5"
    assert last_marked_answer("#### 1\n#### 2") == "2"
    assert last_marked_answer("#### no number here") is None


def test_last_number_reads_signs_commas_and_ignores_hyphens():
    assert last_number("I have 3 apples and 1,250 pears.") == "1250"
    assert last_number("it dropped to -4 degrees") == "-4"
    assert last_number("read pages 3-4") == "4"
    assert last_number("the list 1,2,3") == "3"
    assert last_number("no digits") is None


def test_last_answer_line():
    assert last_answer_line("work\nAnswer: $\\frac{1}{2}$.") == "\\frac{1}{2}"
    assert last_answer_line("answer: 1\nANSWER : 2") == "2"
    assert last_answer_line("nothing") is None


# (response, ground truth, method, verl's score, ember's normalised score): verl 0.9's
# gsm8k.compute_score gives the first number (worked out from its code by hand), and ember's
# default must give the same; normalize=True gives the second. (An integer ground truth, which
# verl scores 0 whatever the answer, is the one departure: see the tests below.)
GSM8K_CASES = [
    ("12 + 30 = 42\n#### 42", "42", "strict", 1.0, 1.0),
    ("#### 41\nwait, no\n#### 42", "42", "strict", 1.0, 1.0),
    ("#### 1,234", "1234", "strict", 1.0, 1.0),  # verl drops the commas of a marked answer
    ("#### -3", "-3", "strict", 1.0, 1.0),
    ("#### 3", "-3", "strict", 0.0, 0.0),
    ("#### $1,234.00", "1234", "strict", 0.0, 1.0),  # verl: "$" right after "#### " is no answer
    ("#### 1234", "1,234", "strict", 0.0, 1.0),  # verl compares with the ground truth as stored
    ("#### 18.00", "18", "strict", 0.0, 1.0),
    ("#### 5.", "5", "strict", 0.0, 1.0),
    ("####72", "72", "strict", 0.0, 1.0),  # verl needs the space
    ("so \\boxed{1,000}", "1000", "strict", 0.0, 1.0),  # verl knows no \boxed
    ("#### 72", "48 + 24 = <<48+24=72>>72\n#### 72", "strict", 0.0, 1.0),  # full solution as ground truth
    ("She pays 3 * 6 = 18 dollars.", "18", "strict", 0.0, 0.0),
    ("She pays 3 * 6 = 18 dollars.", "18", "flexible", 1.0, 1.0),
    ("so \\boxed{1,000} dollars for 2 days", "1000", "flexible", 0.0, 1.0),  # verl: the last number, 2
    ("#### 42 (that is 40 + 2)", "42", "flexible", 0.0, 1.0),  # ember prefers the marked answer
    ("The total is 1,250.", "1250", "flexible", 0.0, 1.0),  # verl keeps "1,250." as written
    ("read pages 3-4", "4", "flexible", 0.0, 1.0),  # verl reads "-4"
    ("#### 42" + "x" * 300, "42", "strict", 0.0, 0.0),  # both read the last 300 characters only
    ("#### 42" + "x" * 300, "42", "flexible", 0.0, 1.0),  # verl's flexible too; ember's looks everywhere
]


class TestGsm8k:
    @pytest.mark.parametrize("response, ground_truth, method, verl_score, normalised_score", GSM8K_CASES)
    def test_default_scores_as_verl_and_normalize_as_ember(self, response, ground_truth, method, verl_score,
                                                          normalised_score):
        assert gsm8k.compute_score(response, ground_truth, method=method) == verl_score
        assert gsm8k.compute_score(response, ground_truth, method=method, normalize=True) == normalised_score

    def test_verl_flexible_answer_of_only_dots_is_a_wrong_answer_not_none(self):
        # verl's loop over the matches ends on a lone "." when nothing else matched
        assert gsm8k.extract_answer("Done . .", "flexible") == "."
        assert gsm8k.compute_score("Done . .", "42", method="flexible", format_score=0.1) == 0.1
        assert gsm8k.compute_score("Done . .", "42", method="flexible", format_score=0.1, normalize=True) == 0.0

    def test_wrong_answer_earns_format_score_and_no_answer_earns_zero(self):
        for normalize in (False, True):
            assert gsm8k.compute_score("#### 41", "42", format_score=0.1, normalize=normalize) == 0.1
            assert gsm8k.compute_score("I don't know", "42", format_score=0.1, normalize=normalize) == 0.0
            assert gsm8k.compute_score("#### 42", "42", score=2.0, normalize=normalize) == 2.0
        assert gsm8k.compute_score("#### $41", "42", format_score=0.1) == 0.0  # verl finds no answer
        assert gsm8k.compute_score("#### $41", "42", format_score=0.1, normalize=True) == 0.1

    def test_normalize_is_settable_from_the_config(self):
        spec = resolve_reward_fn(target_spec={"_target_": "ember.rewards.gsm8k.compute_score", "normalize": True})
        assert spec.load()(RewardItem("openai/gsm8k", "#### $1,234.00", "1234")) == 1.0

    def test_unknown_method_is_an_error(self):
        with pytest.raises(ValueError, match="strict"):
            gsm8k.compute_score("#### 1", "1", method="lenient")

    def test_an_integer_ground_truth_from_a_parquet_column_scores_as_its_digits(self, tmp_path):
        # verl compares "72" with 72 and scores every response 0; the parquet here stores the answer as int64
        rows = [rl_row("What is 70 + 2?", 72, data_source="openai/gsm8k"), rl_row("What is 1 - 2?", -1, data_source="openai/gsm8k")]
        dataset = RLDataset(str(write_parquet(rows, tmp_path / "ints.parquet")), make_tokenizer(), max_prompt_length=1000)
        first, second = dataset[0], dataset[1]
        assert first.ground_truth == 72 and not isinstance(first.ground_truth, str)
        assert default_compute_score(first.data_source, "so #### 72", first.ground_truth) == 1.0
        assert default_compute_score(second.data_source, "so #### -1", second.ground_truth) == 1.0
        assert default_compute_score(first.data_source, "so #### 71", first.ground_truth) == 0.0
        assert gsm8k.compute_score("#### 72", np.int64(72)) == 1.0

    @pytest.mark.parametrize("ground_truth", [72.0, None, [72], True])
    def test_a_ground_truth_strict_scoring_cannot_match_is_an_error_that_says_to_store_a_string(self, ground_truth):
        with pytest.raises(TypeError, match="as a string"):
            gsm8k.compute_score("#### 72", ground_truth)
        assert gsm8k.compute_score("#### 72", 72.0, normalize=True) == 1.0  # normalised, 72.0 reads as 72


class TestMath:
    @pytest.mark.parametrize(
        "response, ground_truth",
        [
            ("so the answer is \\boxed{\\frac{1}{2}}", "0.5"),
            ("\\boxed{0.5}", "\\frac{1}{2}"),
            ("\\boxed{2}", "2"),
            ("\\fbox{\\dfrac{3}{4}}", "3/4"),
            ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
            ("\\boxed{x = 5}", "5"),
            ("\\boxed{\\{2,1\\}}", "\\{1,2\\}"),
            ("Work.\nAnswer: 17", "17"),  # DAPO's answer line
            ("\\boxed{4}", "The area is $\\boxed{4}$."),  # reference given as a solution
        ],
    )
    def test_equivalent_answers_score_one(self, response, ground_truth):
        assert math_reward.compute_score(response, ground_truth) == 1.0

    def test_wrong_or_missing_answers_score_zero(self):
        assert math_reward.compute_score("\\boxed{3}", "2") == 0.0
        assert math_reward.compute_score("the answer is 2", "2") == 0.0  # no box, no answer line
        assert math_reward.compute_score("\\boxed{1} then \\boxed{3}", "1") == 0.0  # last box counts

    def test_unparsable_answers_fall_back_to_normalised_strings(self):
        # math_verify parses neither side; spacing and $ do not matter to the fallback.
        assert math_reward.is_equivalent("\\text{}", "$\\text{ }$")
        assert not math_reward.is_equivalent("\\text{}", "\\$")


    def test_works_off_the_main_thread_where_signal_timeouts_are_unavailable(self):
        with ThreadPoolExecutor(max_workers=1) as executor:
            score = executor.submit(math_reward.compute_score, "\\boxed{\\frac{1}{2}}", "0.5")
            assert score.result() == 1.0


class TestArithmetic:
    def test_marked_answer_then_last_number(self):
        assert arithmetic.compute_score("3 + 4 = 7\n#### 7", "7") == 1.0
        assert arithmetic.compute_score("3 + 4 = 7", 7) == 1.0
        assert arithmetic.compute_score("#### 7 because 3 + 4", "7") == 1.0
        assert arithmetic.compute_score("-2 - 3 = -5", "-5") == 1.0
        assert arithmetic.compute_score("#### 7.0", "7") == 1.0

    def test_exact_integer_match(self):
        assert arithmetic.compute_score("#### 7.5", "7") == 0.0
        assert arithmetic.compute_score("#### 8", "7", format_score=0.1) == 0.1
        assert arithmetic.compute_score("no idea", "7", format_score=0.1) == 0.0

    def test_non_integer_ground_truth_is_an_error(self):
        with pytest.raises(ValueError, match="integer"):
            arithmetic.compute_score("#### 7", "seven")


class TestRouting:
    @pytest.mark.parametrize("data_source", ["openai/gsm8k", "gsm8k"])
    def test_gsm8k_sources_use_strict_gsm8k(self, data_source):
        assert default_compute_score(data_source, "#### 42", "42") == 1.0
        assert default_compute_score(data_source, "it is 42", "42") == 0.0  # strict: no marker

    @pytest.mark.parametrize(
        "data_source",
        [
            "lighteval/MATH",
            "DigitalLearningGmbH/MATH-lighteval",
            "HuggingFaceH4/MATH-500",
            "math",
            "math_dapo_reasoning",
        ],
    )
    def test_math_sources_use_equivalence(self, data_source):
        assert default_compute_score(data_source, "\\boxed{\\frac{1}{2}}", "0.5", None) == 1.0

    @pytest.mark.parametrize("data_source", ["math_dapo", "aime24", "aime_2025"])
    def test_dapo_sources_score_as_verls_math_dapo(self, data_source):
        """verl's routing: `math_dapo` and every `aime*` source to its DAPO scorer, +1 or -1 on the Answer line."""
        right = default_compute_score(data_source, "so x = 12.\nAnswer: 12", "12", None)
        assert right == {"score": 1.0, "acc": 1.0, "pred": "12"}
        wrong = default_compute_score(data_source, "Answer: 13", "12", None)
        assert (wrong["score"], wrong["acc"]) == (-1.0, 0.0)

    @pytest.mark.parametrize("data_source", ["ember/arithmetic/add2", "ember/arithmetic", "arithmetic"])
    def test_arithmetic_sources(self, data_source):
        assert default_compute_score(data_source, "59 + 63 = 122\n#### 122", "122") == 1.0
        assert default_compute_score(data_source, "3 + 4 = 7", "7") == 1.0

    def test_unknown_source_names_the_known_ones_and_the_fix(self):
        with pytest.raises(RewardConfigError) as raised:
            default_compute_score("my/dataset", "#### 1", "1")
        message = str(raised.value)
        assert "'my/dataset'" in message
        assert "openai/gsm8k" in message and "lighteval/MATH" in message
        assert "custom_reward_function.path" in message


class TestMathDapo:
    """verl's DAPO reward: the last `Answer:` line in the response's last 300 characters, normalised as Minerva's
    evaluation does, against the normalised reference; +1 or -1 (and acc 1 or 0)."""

    @pytest.mark.parametrize("response, ground_truth", [
        ("The total is 1,234 apples.\nAnswer: 1,234", "1234"),  # thousands separators
        ("Answer: $\\frac12$", "\\frac{1}{2}"),  # math between dollars, shorthand fractions
        ("Answer: 5 dollars", "5"),  # units dropped
        ("answer : x = 7", "7"),  # any case, the text after the last =
        ("Answer: 3\nchecking...\nAnswer: \\boxed{4}", "4"),  # the last Answer line, a box unwrapped
        ("Answer: 90^\\circ", "90"),
    ])
    def test_equal_after_normalising_scores_plus_one(self, response, ground_truth):
        assert math_dapo.compute_score(response, ground_truth)["score"] == 1.0

    def test_wrong_missing_or_too_early_answers_score_minus_one(self):
        assert math_dapo.compute_score("Answer: 5", "6") == {"score": -1.0, "acc": 0.0, "pred": "5"}
        assert math_dapo.compute_score("\\boxed{6}", "6") == {"score": -1.0, "acc": 0.0, "pred": "[INVALID]"}
        early = "Answer: 6\n" + "more reasoning. " * 30  # past the last 300 characters
        assert math_dapo.compute_score(early, "6")["score"] == -1.0

    def test_a_numeric_reference_is_read_as_text(self):
        assert math_dapo.compute_score("Answer: 42", 42)["score"] == 1.0
