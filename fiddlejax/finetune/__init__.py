"""Fine-tuning objectives and parameterizations on top of any layout: LoRA adapters on a frozen
base (:mod:`.lora`) and Direct Preference Optimization (:mod:`.dpo`)."""
