#!/usr/bin/env bash
# NLA on SmolLM2-135M-Instruct (30 layers; vectors of layer 20) on one GPU, on the GPU host:
#   prepare   rejoin the GGUF pieces in /tmp, convert, write documents, extract RL/SFT rows (+ _random)
#   sft       SFT of the actor and of the critic
#   rl        NLA GRPO from the two SFT folders, on the canonical RL rows and on their _random file
#   control   the fork's control end to end: SFT of both roles on the _random SFT rows (explanations that
#             do not match their vectors), then GRPO from those folders on the _random RL rows
#   truncate  a few steps with the critic cut after layer 20 against the full critic (step time)
# Usage: run_gpu.sh OUT STAGE...   (results: metrics files under OUT)
set -euo pipefail
out=${1:?output folder}; shift
work=/tmp/nla_smollm2
marker='§'  # SmolLM2's tokenizer keeps none of the fork's 40 marker characters as one token
layer=20
mkdir -p "$work" "$out"
here=$(dirname "$0")
nla() { python3 -m ember nla "$@" 2>&1 | grep -v -e Warning -e "it/s]" ; }

for stage in "$@"; do
case $stage in
prepare)
  cat /tmp/SmolLM2-135M-Instruct.Q4_1.gguf.part* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -c "import sys; sys.path.insert(0, '$here/../smollm2_addition'); from prepare import convert_gguf; \
convert_gguf('/tmp/SmolLM2-135M-Instruct.Q4_1.gguf', '$work/model')"
  python3 "$here/make_documents.py" "$work/documents.parquet" 3072
  common=(model.name=$work/model dataset.input_parquet=$work/documents.parquet dataset.text_column=text
          model.layer_index=$layer output.injection_token=$marker sampling.parallel_batch_size=64 output.overwrite=true)
  nla extract "${common[@]}" mode=sft dataset.slice_length=1024 sampling.total_activations=1024 output.path_prefix=$work/sft \
      output.random_variant.enabled=true
  nla extract "${common[@]}" mode=rl dataset.slice_start=1024 sampling.total_activations=2048 \
      output.path_prefix=$work/rl output.random_variant.enabled=true
  ;;
sft|control)
  suffix=""; [ "$stage" = control ] && suffix=_random
  for mode in actor critic; do
    nla sft model.partial_pretrain=$work/model data.train_files=$work/sft_layer$layer$suffix.parquet \
        nla.train_mode=$mode nla.injection.injection_token=$marker nla.critic.output_layer_index=$layer \
        data.train_batch_size=32 data.micro_batch_size_per_gpu=32 data.max_length=256 trainer.total_epochs=2 \
        optim.lr=5e-5 nla.critic_lr=5e-5 model.enable_gradient_checkpointing=false \
        trainer.default_local_dir=$work/sft_$mode$suffix trainer.logger=[console,tensorboard]
    cp $work/sft_$mode$suffix/metrics.jsonl "$out/sft_${mode}${suffix}_metrics.jsonl"
  done
  if [ "$stage" = control ]; then bash "$0" "$out" rl_control; fi
  ;;
rl|truncate|rl_control)
  steps=40; variants=("canonical:rl_layer$layer.parquet" "random:rl_layer${layer}_random.parquet")
  if [ "$stage" = truncate ]; then steps=6; variants=("full:rl_layer$layer.parquet" "cut:rl_layer$layer.parquet"); fi
  if [ "$stage" = rl_control ]; then variants=("control:rl_layer${layer}_random.parquet"); fi
  for variant in "${variants[@]}"; do
    name=${variant%%:*}; file=${variant#*:}
    extra=(); [ "$name" = cut ] && extra=(critic.model.truncate_at_layer=$layer)
    sft=""; [ "$name" = control ] && sft=_random
    nla train actor_rollout_ref.model.path=$work/sft_actor$sft/hf_model critic.model.path=$work/sft_critic$sft/hf_model \
        critic.output_layer_index=$layer nla.injection.injection_token=$marker data.train_files=[$work/$file] \
        data.train_batch_size=32 actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.ppo_mini_batch_size=256 \
        data.max_prompt_length=64 data.max_response_length=48 trainer.total_training_steps=$steps \
        actor_rollout_ref.actor.optim.lr=1e-5 critic.optim.lr=1e-5 trainer.n_gpus_per_node=1 \
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 critic.ppo_micro_batch_size_per_gpu=64 \
        actor_rollout_ref.actor.fsdp_config.param_offload=false actor_rollout_ref.actor.fsdp_config.optimizer_offload=false \
        critic.model.fsdp_config.param_offload=false critic.model.fsdp_config.optimizer_offload=false \
        actor_rollout_ref.model.enable_gradient_checkpointing=false critic.model.enable_gradient_checkpointing=false \
        trainer.logger=[console,tensorboard] trainer.rollout_data_dir=$work/rollouts_$name nla_eval.enabled=false \
        trainer.default_local_dir=$work/rl_$name trainer.save_freq=-1 "${extra[@]}"
    cp $work/rl_$name/metrics.jsonl "$out/rl_${name}_metrics.jsonl"
    cp $work/rollouts_$name/$steps.jsonl "$out/rl_${name}_last_rollouts.jsonl"
  done
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
done
