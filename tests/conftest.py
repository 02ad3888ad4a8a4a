"""Test setup: 8 virtual CPU devices (for sharding tests), offline Hugging Face, shared fixtures."""

import os
import tempfile

# 8 virtual CPU devices, and LLVM at optimisation level 1 without its expensive passes: most test time
# is compiling (tests/test_dpo.py with the GRPO learning test, alone: 219 s -> 193 s at level 1, 197 s
# without the passes; the whole suite on an Intel AVX-512 machine that drifts: 22-24 min before, 19.4-22.6
# min after). Level 0 was faster still but moved the float round-off enough that
# the RL learning tests' SFT start began at 41.5 % instead of ~30 %.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=1 "
                                   "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# JAX's persistent compilation cache, shared by the xdist workers and every subprocess a test starts
# (the CLI kill/resume and multi-process tests compile the same programs again in each process): a
# folder of this test run only, so nothing carries over between runs. Compiled programs are keyed on
# the program, the flags and the JAX version; a cache hit is the same executable.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"posttrain-jax-cache-{os.environ.get('PYTEST_XDIST_TESTRUNUID') or os.getpid()}"))
# Every program, not only those that compile for over a second (JAX's default): the random initialisers
# compile once per parameter shape (0.4-2 s each) and the subprocess tests build the same models again.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import sys  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from hf_models import FAMILIES, make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def trl():
    """TRL 1.16's GRPO / RLOO trainer classes and torch, for the float64 parity tests (tests/trl_stand_ins.py)."""
    import types
    import warnings

    import torch  # test dependencies: a missing one is an error, never a silent skip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.trainer.grpo_trainer import GRPOTrainer
        from trl.trainer.rloo_trainer import RLOOTrainer
    return types.SimpleNamespace(torch=torch, GRPOTrainer=GRPOTrainer, RLOOTrainer=RLOOTrainer)


@pytest.fixture
def x64():
    """float64 inside a test only (`pytestmark = pytest.mark.usefixtures("x64")`); the rest of the
    suite keeps JAX's float32 default."""
    import jax

    with jax.enable_x64(True):
        yield


def nested(d: dict, over: dict) -> dict:
    """`d` with dotted-key overrides applied in place ({"train.steps": 4} sets d["train"]["steps"])."""
    for k, v in over.items():
        node = d
        *path, leaf = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    return d


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> folder of a tiny random HF checkpoint (built once per test session)."""
    root = tmp_path_factory.mktemp("hf")
    return {fam: make_checkpoint(fam, root / fam) for fam in FAMILIES}


# The files that take longest, longest first. `make test` gives whole files to its two workers in this
# order (`--dist loadfile --no-loadscope-reorder`: a module's fixtures are built once), so the long ones
# start first and neither worker finishes minutes after the other. Order from `--durations=0`.
LONGEST_FIRST = ["test_faults.py", "test_rl_learning.py", "test_hybrid_learning.py",
                 "test_vlm_learning.py", "test_docs.py", "test_distill.py", "test_ppo.py",
                 "test_grpo.py", "test_cli.py", "test_gguf.py", "test_gguf_real.py",
                 "test_dpo.py", "test_attention.py", "test_branches.py", "test_moe.py", "test_offpolicy.py",
                 "test_gpt_oss.py", "test_kto.py", "test_online_dpo.py", "test_agentic_rollout.py",
                 "test_gemma4.py", "test_multiprocess_sft.py", "test_sharding.py", "test_models.py",
                 "test_pipeline.py", "test_generate.py", "test_reward_model.py"]


# `make test-fast` (the edit loop) leaves these files out: -m "not slow". They train whole runs, start
# processes or compare real checkpoints; `make test` runs everything.
SLOW_FILES = set(LONGEST_FIRST) | {"test_multiprocess.py", "test_sharded_sft.py", "test_nonfinite.py",
                                   "test_agentic_env.py", "test_report.py", "test_gpu_bench.py",
                                   "test_routing_replay.py"}

# ... except these tests of those files, the core parity checks on tiny shapes, which the edit loop keeps: the
# logits of every model family against transformers, the sampler's log-probs against the trainer's forward and its
# greedy tokens against transformers' generate, the attention back-ends against the dense reference, the MoE router
# loss and KTO against TRL (the other TRL loss families, DPO / IPO / ..., GRPO variants, PPO and distillation, live
# in the *_losses.py files, which are fast whole). A name is a test function (every parameter) or one `name[param]`.
FAST_TESTS = {
    "test_models.py": {"test_logits_match_transformers"},
    "test_moe.py": {"test_logits_and_router_logits_match_transformers", "test_load_balancing_loss_equals_transformers"},
    "test_gemma4.py": {"test_logits_match_transformers"},
    "test_gpt_oss.py": {"test_logits_match_transformers_with_right_padding[11]"},
    "test_generate.py": {"test_logprobs_equal_trainer_forward", "test_greedy_matches_transformers_generate[llama]"},
    "test_attention.py": {"test_blockwise_equals_dense", "test_blockwise_equals_dense_with_sinks",
                          "test_empty_rows_output_zero", "test_tiles_skipped_between_branches_and_above_diagonal",
                          "test_cached_prefill_blockwise_equals_dense", "test_choose"},
    "test_kto.py": {"test_kto_matches_trl", "test_policy_equals_reference_and_padding_rows"},
}


# and the slow tests of files that are otherwise fast (13.5 min of `make test-fast` on 2 busy cores before: prefix
# sharing, greedy loops, LoRA, in-loop evaluations, compile-cache runs, subprocesses; the logits parity stays fast)
SLOW_TESTS = {
    "test_qwen3_5.py": {"test_prefix_shared_rows_equal_unshared_rows_logps_and_gradients",
                        "test_packed_segments_equal_separate_rows",
                        "test_greedy_24_tokens_equal_a_cache_free_transformers_loop",
                        "test_stop_sequence_then_extend_continues_exactly",
                        "test_lora_on_linear_layers_targets_by_name_and_merges_exactly",
                        "test_sampler_logprobs_equal_the_trainer_forward",
                        "test_logits_match_transformers_with_right_padding[150]"},
    "test_qwen3_5_moe.py": {"test_packed_segments_and_greedy_24_tokens_equal_transformers",
                            "test_logits_match_transformers_with_right_padding[150]"},
    "test_deltanet.py": {"test_gated_deltanet_layer_equals_transformers", "test_training_memory_is_linear_in_length",
                         "test_chunked_gradients_equal_recurrent_and_padding_passes_the_state"},
    "test_compile_cache.py": {"test_second_run_loads_the_compiled_programs",
                              "test_off_and_a_users_jax_cache_are_respected"},
    "test_evals.py": {"test_grpo_evaluates_in_the_loop_keeps_the_best_step_and_exports_it",
                      "test_sft_logs_its_loss_and_sampled_evaluation_of_the_same_held_out_rows",
                      "test_sampled_eval_equals_a_hand_count_of_the_same_samples"},
    "test_remat.py": {"test_bfloat16_state_keeps_its_dtypes"},  # the file marks its slow remat cases itself
    # 9-13 s each on 2 cores (make test-fast 3:17 on an idle AMD EPYC with them): the deltanet and packing
    # invariants keep their fast siblings (logits parity, gradient accumulation), the escapes their root run
    "test_train.py": {"test_lora_trains_adapters_only_and_merges_exactly",
                      "test_packed_and_unpacked_batches_give_the_same_loss"},
    "test_sandbox_escapes.py": {"test_sandbox_escape_attempts_all_fail_for_an_unprivileged_trainer"},
    "test_qwen3_next.py": {"test_packed_segments_and_greedy_24_tokens_equal_transformers",
                           "test_logits_match_transformers_with_right_padding[150]",
                           "test_scaled_rope_keeps_the_partial_rotary_factor"},
    "test_sft_cli.py": {"test_too_long_rows_with_keep_policies_train", "test_skip_bad_rows_warns_and_trains"},
    "test_no_data_loss.py": {"test_resume_drops_a_cut_last_metrics_line_and_ends_bitwise_equal"},
    # two tiny train steps compiled, five lowered; the edit loop keeps the per-count schedule checks
    "test_schedule.py": {"test_train_steps_equal_the_constant_number_step_bitwise",
                         "test_runs_of_other_lengths_and_lrs_lower_one_program"},
    "test_seventh_trainer.py": {"test_a_seventh_trainer_is_one_module",
                                "test_an_eighth_rl_recipe_is_one_module_on_the_rl_base"},  # 37 s: a whole RL run
    # 24-27 s each (llama: 21 CPU s, four samplers compiled): the edit loop keeps a sampler on a packed cache
    # (test_stop_then_extend_with_a_packed_cache) and the packed reads against the plain ones, soft-cap, sinks and
    # window included (test_dense_reads_a_packed_cache_exactly)
    "test_kv_pack.py": {"test_sampler_with_a_packed_cache_equals_the_plain_one"},
    # 20-50 s each (a 70-token greedy sampler and transformers twice, a multi-turn, a GRPO setup): the edit loop keeps
    # the float8 write's saturation, the names refused and the rollout checks
    "test_kv_dtype.py": {"test_an_8_bit_cache_equals_transformers_with_a_rounded_cache",
                         "test_multi_turn_keeps_the_8_bit_cache", "test_grpo_samples_with_a_float8_cache"},
    "test_hf_config_json.py": {"test_loading_a_model_folder_imports_no_torch"},  # a subprocess; make package runs it
    # Vision-language and scanned layers (make test-fast 5:02 with them, 2:58 before): the edit loop keeps each
    # family's logits against transformers, the image encodings against the processors, the image errors and the
    # scanned forward; the rest (greedy loops, sampler, gradients, exports, whole runs: 3-90 s each) runs in make test
    "test_vlm_gemma3.py": {"test_image_features_equal_transformers",
                           "test_blockwise_attention_equals_dense_with_images",
                           "test_attention_mask_and_gradients_with_image_blocks", "test_greedy_equals_transformers",
                           "test_export_round_trip", "test_text_only_equals_transformers_without_images",
                           "test_sampler_with_images_equals_transformers_generate",
                           "test_logits_equal_transformers[two images a row]"},
    "test_vlm_qwen3vl.py": {"test_vision_tower_matches", "test_greedy_matches_transformers", "test_export_round_trip",
                            "test_text_only_exports_as_qwen3", "test_logits_match_transformers[two-images]",
                            "test_logits_match_transformers[batch-padded]"},
    "test_vlm_sampler.py": {"test_greedy_batch_matches_transformers", "test_text_rows_beside_image_rows",
                            "test_logprobs_equal_trainer_forward", "test_precomputed_features_equal_pixels",
                            "test_image_batches_reuse_the_compiled_prefill", "test_cli_generate_with_images"},
    "test_vlm_data.py": {"test_sft_loss_on_image_rows_equals_transformers",
                         "test_sft_recipe_on_image_rows_learns_and_freezes_the_tower",
                         "test_a_datasets_folder_with_an_image_column"},
    # packed image rows and Gemma 3 image rows: 10-45 s each on 2 busy cores alone (building the folders, compiling
    # the towers), none under 3 s; the Gemma 3 processor-setting refusals stay in the edit loop
    "test_vlm_packing.py": {"test_qwen3vl_packed_rows_equal_transformers_per_example",
                            "test_gemma3_packed_rows_equal_transformers_per_example",
                            "test_sft_loss_of_packed_image_rows_equals_unpacked_and_transformers",
                            "test_sft_recipe_with_packing_on_image_rows",
                            "test_gemma3_image_rows_sft_loss_equals_transformers"},
    "test_vlm_grpo.py": {"test_grpo_recipe_on_image_prompts", "test_prefix_shared_image_rows_equal_unshared_rows",
                         "test_grpo_loss_on_image_rows_equals_trl_on_transformers_logps"},
    "test_vlm_dpo.py": {"test_prefix_shared_image_pair_rows_equal_unshared_rows",  # 50 s, 60 s, 31 s
                        "test_dpo_loss_on_image_rows_equals_trl", "test_dpo_recipe_on_image_pairs_and_export"},
    # Gemma 3 folders through the recipes and the CLI: whole runs and exports, 18-60 s each on 2 busy cores
    "test_vlm_gemma3_recipes.py": {"test_sft_trains_gemma3_on_image_rows_and_exports",
                                   "test_sft_lora_on_gemma3_resumes_and_exports_from_the_cli",
                                   "test_cli_generate_with_an_image_equals_transformers",
                                   "test_dpo_on_gemma3_image_pairs", "test_grpo_on_gemma3_image_prompts"},
    "test_scan_layers.py": {"test_cached_forward_equals_the_loop", "test_sampler_equals_the_loop",
                            "test_loss_and_grads_equal_the_loop", "test_train_steps_equal_the_loop"},
    # (#53, make test-fast <= 3 min) whole command-line runs: the export safety tests' shared 4-step SFT run and the
    # profiler / MFU run (9.5 and 5.8 CPU s; test_sft_cli's 2-step run stays the edit loop's one command-line run)
    "test_ops_run.py": {"test_sinks_profiler_and_mfu_during_a_run"},
    # (#53, seventh stop) 7-13 s each alone on one core, none a family's logits / sampler / attention / TRL-loss check:
    # the splash kernel's segment case (interpreted on a CPU; its soft-cap case stays), the PPO loss on-policy (the
    # loss-vs-reference cases stay), chunked log-probs with gradients (the budget and no-whole-logits checks stay),
    # which layers scan, the Qwen3.5-MoE preset's plans (its logits parity stays)
    "test_attention_tpu.py": {"test_splash_equals_dense[segments]",
                              # the opt-in decode kernel, interpreted: its window + soft-cap and float8 cases stay
                              "test_decode_kernel_equals_dense[f32]", "test_decode_kernel_equals_dense[packed]",
                              "test_decode_kernel_equals_dense[one_block]", "test_decode_kernel_equals_dense[bf16]"},
    "test_ppo_losses.py": {"test_ppo_loss_on_policy"},
    "test_chunked_logps.py": {"test_chunked_equals_unchunked_values_and_gradients"},
}
SLOW_TESTS["test_scan_layers.py"] |= {"test_which_layers_scan"}
SLOW_TESTS["test_sampler_programs.py"] = {"test_split_programs_equal_the_one_program_decode",  # ~20 s each
                                          "test_prefill_compile_options_reach_the_prefill_alone"}  # ~6 s, an opt-in
SLOW_TESTS["test_qwen3_5_moe.py"] |= {"test_preset_is_transformers_default_config_and_plans"}
SLOW_TESTS["test_no_data_loss.py"] |= {"test_export_into_the_run_folder_is_refused_and_the_run_still_exports",
                                       "test_export_over_a_folder_with_user_files_needs_overwrite",
                                       "test_full_disk_during_export_keeps_the_previous_export"}


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise
    for item in items:
        names = {item.name, getattr(item, "originalname", None)}
        if item.path.name in SLOW_FILES and not names & FAST_TESTS.get(item.path.name, set()):
            item.add_marker(pytest.mark.slow)
        elif names & SLOW_TESTS.get(item.path.name, set()):
            item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session):
    """The run's compilation cache folder goes with the run (the xdist controller removes it)."""
    import shutil

    if not hasattr(session.config, "workerinput"):
        path = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
        if os.path.basename(path).startswith("posttrain-jax-cache-"):
            shutil.rmtree(path, ignore_errors=True)
