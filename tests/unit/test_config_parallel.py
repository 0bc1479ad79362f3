"""Megatron sizes against a model's shape (ember/config/parallel.py): each size megatron-core cannot split the
model by is named with the sizes that would."""

from ember.config.parallel import megatron_size_errors
from ember.config.schema.megatron import MegatronConfig


def test_sizes_that_split_the_model_pass():
    megatron = MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              virtual_pipeline_model_parallel_size=3, expert_model_parallel_size=4)
    assert megatron_size_errors("actor.megatron", megatron, heads=14, kv_heads=2, layers=24, experts=60) == []


def test_each_size_that_does_not_split_the_model_is_named_with_sizes_that_do():
    megatron = MegatronConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=5,
                              expert_model_parallel_size=8)
    errors = megatron_size_errors("critic.megatron", megatron, heads=14, kv_heads=2, layers=24, experts=60)
    assert errors == [
        "critic.megatron.tensor_model_parallel_size=4 does not divide the model's 14 attention heads; sizes that do: "
        "1, 2, 7",
        "critic.megatron.tensor_model_parallel_size=4 does not divide the model's 2 key-value heads (grouped-query "
        "attention); sizes that do: 1, 2",
        "critic.megatron.pipeline_model_parallel_size=5 = 5 stages do not divide the model's 24 decoder layers; stage "
        "counts that do: 3, 4, 6",
        "critic.megatron.expert_model_parallel_size=8 does not divide the model's 60 experts; sizes that do: 5, 6, 10"]


def test_expert_parallelism_on_a_dense_model_is_refused():
    errors = megatron_size_errors("model.megatron", MegatronConfig(expert_model_parallel_size=2), heads=4, kv_heads=2,
                                  layers=2, experts=None)
    assert errors == ["model.megatron.expert_model_parallel_size=2: the model has no experts (not a MoE model); set "
                      "it to 1"]


def test_uneven_pipeline_stages_are_left_to_megatron_core():
    megatron = MegatronConfig(pipeline_model_parallel_size=3,
                              override_transformer_config={"num_layers_in_first_pipeline_stage": 10,
                                                           "num_layers_in_last_pipeline_stage": 10})
    assert megatron_size_errors("actor.megatron", megatron, heads=4, kv_heads=2, layers=28, experts=None) == []
