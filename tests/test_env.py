"""The search-QA environment: registration, the episode rules, snapshots, and robustness to any text."""

from __future__ import annotations

import copy
import pickle

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from envs.search_qa import INVALID_ACTION, NO_RESULTS, SearchQAState, parse_action

THINK = "<think>reasoning</think>"


@pytest.fixture(scope="module")
def hotpot_dev(data_dir):
    return gym.make("HotpotQA-v0", split="dev")


def search(query: str) -> str:
    return f"{THINK}<search>{query}</search>"


def answer(text: str) -> str:
    return f"{THINK}<answer>{text}</answer>"


def is_well_formed(observation: str) -> bool:
    information = observation.startswith("\n\n<information>") and observation.endswith("</information>\n\n")
    invalid = observation.startswith("\n\nInvalid action: ") and observation.endswith("\n\n")
    return observation == "" or information or invalid


# -- parse_action (pure) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "argument", "step_text"),
    [
        ("<think>a</think><search> x y </search>", "search", "x y", "<think>a</think><search> x y </search>"),
        ("<answer>Paris</answer> trailing", "answer", "Paris", "<answer>Paris</answer>"),
        # the first closing tag decides, the matching opening tag is the last one before it
        ("<answer>a <search>q</search> b</answer>", "search", "q", "<answer>a <search>q</search>"),
        ("<search>q1</search><search>q2</search>", "search", "q1", "<search>q1</search>"),
        ("<answer></answer>", "answer", "", "<answer></answer>"),
        ("<search>   </search>", "invalid", "", "<search>   </search>"),
        ("q</search>", "invalid", "", "q</search>"),
        ("<search>unclosed", "invalid", "", "<search>unclosed"),
        ("", "invalid", "", ""),
    ],
)
def test_parse_action(text, kind, argument, step_text):
    parsed = parse_action(text)
    assert (parsed.kind, parsed.argument, parsed.step_text) == (kind, argument, step_text)
    assert (parsed.reason != "") == (kind == "invalid")


# -- registration and the Gymnasium contract -------------------------------------------------------------------


def test_the_papers_seven_ids_and_the_generated_worlds_are_registered():
    expected = {"HotpotQA-v0", "2WikiMultihopQA-v0", "Musique-v0", "NQ-v0", "TriviaQA-v0", "PopQA-v0", "Bamboogle-v0"}
    assert expected == set(envs.PAPER_ENV_IDS)
    assert expected | {"SynthHop-v0", "SynthBranch-v0"} == set(envs.ENV_IDS)
    assert set(envs.ENV_IDS) <= set(gym.registry)


@pytest.mark.parametrize("env_id", list(envs.ENV_IDS))
def test_check_env(data_dir, env_id):
    env = gym.make(env_id)
    check_env(env.unwrapped, skip_render_check=True)
    assert len(env.unwrapped.records) > 0


@pytest.mark.parametrize("env_id", list(envs.ENV_IDS))
def test_eval_split_exists(data_dir, env_id):
    env = gym.make(env_id, split=envs.eval_split(env_id))
    prompt, info = env.reset(seed=0)
    assert env.unwrapped.record.question.rstrip("?") in prompt
    assert set(info) == {"index", "id"}


def test_reset_index_and_seed(hotpot_dev):
    prompt, info = hotpot_dev.reset(options={"index": 5})
    assert info["index"] == 5 and hotpot_dev.unwrapped.record.question.rstrip("?") in prompt
    assert prompt.rstrip().endswith("?")
    first = [hotpot_dev.reset(seed=7)[1]["index"] for _ in range(2)]
    assert first[0] == first[1]
    drawn = {hotpot_dev.reset(seed=s)[1]["index"] for s in range(20)}
    assert len(drawn) > 10  # seeds pick different questions
    with pytest.raises(ValueError, match="index"):
        hotpot_dev.reset(options={"index": 10**6})


def test_options_through_gym_make(data_dir):
    env = gym.make("HotpotQA-v0", split="dev", topk=5, max_turns=1, reward="em", max_obs_chars=100)
    env.reset(seed=0, options={"index": 0})
    title = env.unwrapped.record.supporting_titles[0]
    observation, *_ = env.step(search(title))
    assert observation.startswith("\n\n<information>Doc 1(Title: ") and observation.endswith("</information>\n\n")
    assert len(observation) == 100 + len("\n\n<information></information>\n\n")  # capped passages
    # max_turns=1: the second step is the last one; "em" scores pure exact match
    _, reward, terminated, truncated, info = env.step(answer(env.unwrapped.record.answers[0]))
    assert (reward, terminated, truncated, info["em"]) == (1.0, True, False, 1.0)


def test_topk_passages(data_dir):
    env = gym.make("HotpotQA-v0", split="dev", topk=5, max_obs_chars=100_000)
    env.reset(options={"index": 0})
    observation, *_ = env.step(search(env.unwrapped.record.supporting_titles[0]))
    assert [f"Doc {i}(Title: " in observation for i in range(1, 7)] == [True] * 5 + [False]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"topk": 0}, "topk"),
        ({"max_turns": -1}, "max_turns"),
        ({"reward": "accuracy"}, "unknown reward"),
        ({"retriever": "tfidf"}, "unknown retriever backend"),
        ({"split": "validation"}, "no split 'validation'"),
        ({"prompt_template": "no placeholder"}, "question"),
        ({"render_mode": "human"}, "render_mode"),
    ],
)
def test_invalid_options_name_the_option(data_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gym.make("HotpotQA-v0", **{"split": "dev", **kwargs})


# -- episode rules ---------------------------------------------------------------------------------------------


def test_search_then_answer_correct_valid(hotpot_dev):
    hotpot_dev.reset(options={"index": 0})
    record = hotpot_dev.unwrapped.record
    observation, reward, terminated, truncated, info = hotpot_dev.step(search(record.supporting_titles[0]))
    assert f"(Title: {record.supporting_titles[0]})" in observation
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info == {"action": "search", "turn": 1, "tool_calls": 1}
    observation, reward, terminated, truncated, info = hotpot_dev.step(
        "<think>found it</think>\n<answer> " + record.answers[0].upper() + ". </answer>"
    )
    assert observation == "" and (reward, terminated, truncated) == (1.0, True, False)
    assert info["em"] == info["f1"] == 1.0 and info["format_valid"] and info["tool_calls"] == 1


@pytest.mark.parametrize(
    ("steps", "expected_reward"),
    [
        ([answer("GOLD")], 1.0),  # correct, valid format
        (["<answer>GOLD</answer>"], 0.8),  # correct, no <think>: invalid format
        ([answer("certainly wrong")], 0.2),  # wrong, valid
        (["garbage", answer("certainly wrong")], 0.1),  # wrong, invalid (an invalid-action message in between)
        (["x", "y", "z", "w"], 0.0),  # no answer before the turn limit
    ],
)
def test_reward_table_through_the_env(hotpot_dev, steps, expected_reward):
    hotpot_dev.reset(options={"index": 3})
    gold = hotpot_dev.unwrapped.record.answers[0]
    for text in steps:
        _, reward, terminated, truncated, _ = hotpot_dev.step(text.replace("GOLD", gold))
    assert reward == pytest.approx(expected_reward) and (terminated or truncated)


def test_turn_limit_disables_search_on_the_last_step(hotpot_dev):
    hotpot_dev.reset(options={"index": 1})
    for turn in range(1, 4):
        observation, _, terminated, truncated, info = hotpot_dev.step(search(f"query {turn}"))
        assert observation.startswith("\n\n<information>") and not (terminated or truncated)
        assert (info["turn"], info["tool_calls"]) == (turn, turn)
    observation, reward, terminated, truncated, info = hotpot_dev.step(search("one more"))
    assert observation == "" and reward == 0.0 and (terminated, truncated) == (False, True)
    assert info["tool_calls"] == 3 and info["answer"] is None and info["em"] == 0.0
    with pytest.raises(RuntimeError, match="reset"):
        hotpot_dev.step(answer("late"))


def test_last_step_answer_is_scored(hotpot_dev):
    hotpot_dev.reset(options={"index": 2})
    for _ in range(3):
        hotpot_dev.step("no action here")
    _, reward, terminated, truncated, info = hotpot_dev.step(answer(hotpot_dev.unwrapped.record.answers[0]))
    assert (terminated, truncated, info["em"], info["turn"], info["tool_calls"]) == (True, False, 1.0, 4, 0)
    assert reward == pytest.approx(0.8)  # correct, but the invalid-action messages break the format


def test_invalid_action_observation_names_the_tags(hotpot_dev):
    hotpot_dev.reset(options={"index": 0})
    observation, _reward, terminated, truncated, info = hotpot_dev.step("I think the answer is 42")
    assert observation == INVALID_ACTION.format(reason=parse_action("").reason)
    assert "<search>" in observation and "<answer>" in observation
    assert info["action"] == "invalid" and info["tool_calls"] == 0 and not (terminated or truncated)


def test_a_step_longer_than_the_action_space_is_an_invalid_action_kept_whole(hotpot_dev):
    from envs.search_qa import MAX_ACTION_CHARS

    hotpot_dev.reset(options={"index": 0})
    thought = "<think>" + "x" * MAX_ACTION_CHARS + "</think>"
    assert not hotpot_dev.action_space.contains(thought + "<answer>a</answer>")
    observation, reward, terminated, truncated, info = hotpot_dev.step(thought + "<answer>a</answer>")
    assert "longer than 65,536 characters" in observation and info["action"] == "invalid"
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert hotpot_dev.unwrapped.get_state().steps[-1][0] == thought + "<answer>a</answer>"  # nothing lost
    # a long tail after the action is not part of the step
    assert parse_action("<answer>a</answer>" + "x" * MAX_ACTION_CHARS).kind == "answer"


def test_query_without_known_words(hotpot_dev):
    hotpot_dev.reset(options={"index": 0})
    observation, *_ = hotpot_dev.step(search("qqqxqzz zzzqxq"))
    assert observation == f"\n\n<information>{NO_RESULTS}</information>\n\n"


def test_render_gives_the_transcript(data_dir):
    env = gym.make("HotpotQA-v0", split="dev", render_mode="ansi")
    prompt, _ = env.reset(options={"index": 0})
    step = search("Fire of Zamani")
    observation, *_ = env.step(step + " ignored tail")
    assert env.render() == prompt + step + observation


# -- snapshots -------------------------------------------------------------------------------------------------

ACTIONS = st.one_of(
    st.sampled_from(["Fire of Zamani", "Wale (rapper)", "Maybach Music", "Nigerian hip hop", "xqzzq"]).map(search),
    st.sampled_from(["Wale", "Ice Prince", "yes"]).map(answer),
    st.sampled_from(["", "<search></search>", "</answer>", "<think>hmm", "plain words"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(ACTIONS, min_size=1, max_size=6), cut=st.integers(0, 6), index=st.integers(0, 593))
def test_snapshot_restore_replays_exactly(hotpot_dev, actions, cut, index):
    def play(env, steps):
        results = []
        for text in steps:
            results.append(env.step(text))
            if results[-1][2] or results[-1][3]:
                break
        return results

    cut = min(cut, len(actions))
    hotpot_dev.reset(options={"index": index})
    head = play(hotpot_dev, actions[:cut])
    if head and (head[-1][2] or head[-1][3]):
        return  # the episode ended before the snapshot point
    snapshot = pickle.loads(pickle.dumps(hotpot_dev.unwrapped.get_state()))
    expected = play(hotpot_dev, actions[cut:])

    fresh = gym.make("HotpotQA-v0", split="dev")
    fresh.reset(seed=123)  # a different question: set_state must replace everything
    fresh.unwrapped.set_state(snapshot)
    assert play(fresh, actions[cut:]) == expected
    assert fresh.unwrapped.get_state() == hotpot_dev.unwrapped.get_state()


def test_state_is_small_and_immutable(hotpot_dev):
    hotpot_dev.reset(options={"index": 0})
    for query in ("Fire of Zamani", "Wale (rapper)", "Maybach Music Group"):
        hotpot_dev.step(search(query))
    state = hotpot_dev.unwrapped.get_state()
    assert isinstance(state, SearchQAState) and len(pickle.dumps(state)) < 16_000
    with pytest.raises(AttributeError):
        state.turn = 0  # frozen: a snapshot cannot change after it was taken


def test_set_state_checks_the_source(data_dir, hotpot_dev):
    hotpot_dev.reset(options={"index": 0})
    other = gym.make("Musique-v0")
    with pytest.raises(ValueError, match="hotpotqa"):
        other.unwrapped.set_state(hotpot_dev.unwrapped.get_state())
    with pytest.raises(TypeError):
        other.unwrapped.set_state({"index": 0})


def test_retriever_is_shared_not_copied(data_dir, hotpot_dev):
    clone = copy.deepcopy(hotpot_dev.unwrapped)
    other = gym.make("Bamboogle-v0")
    assert clone.retriever is hotpot_dev.unwrapped.retriever is other.unwrapped.retriever


# -- fuzz: any text is a well-formed step ----------------------------------------------------------------------

TAGS = ["<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>"]
FUZZ_TEXT = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(st.sampled_from(TAGS), st.text(max_size=20)), max_size=30).map("".join),
    st.binary(max_size=200).map(lambda b: b.decode("utf-8", errors="replace")),
    st.integers(0, 200_000).map(lambda n: "<search>" + "a" * n),
)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=FUZZ_TEXT)
def test_fuzz_any_text_gives_a_well_formed_observation(hotpot_dev, text):
    env = hotpot_dev.unwrapped
    if env._state is None or env._state.done:
        env.reset(options={"index": 0})
    observation, reward, _terminated, _truncated, info = env.step(text)
    assert isinstance(observation, str) and is_well_formed(observation)
    assert env.observation_space.contains(observation)
    assert info["action"] in {"search", "answer", "invalid"} and 0.0 <= reward <= 1.0
    assert len(observation) <= env.max_obs_chars + len("\n\n<information></information>\n\n") or not observation


@pytest.mark.parametrize(
    "text",
    ["", "\x00\x01\x02", "<search>" * 1000, "</search>" * 3, "<search><search>q</search></search>",
     "<answer>" + "é" * 100_000 + "</answer>", "🙂<search>北京</search>", "<search>\u202e\ufeff</search>"],
)
def test_fuzz_edge_cases(hotpot_dev, text):
    hotpot_dev.reset(options={"index": 0})
    observation, *_ = hotpot_dev.step(text)
    assert is_well_formed(observation)
