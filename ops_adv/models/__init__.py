"""The model passes: what turns a user's model into one running ops_adv's ops.

- `convert`: convert_model / explain_model (layers by what they are, BatchNorm folding);
- `blocks`: decoder blocks' forward rewritten to the fused ops (add_rms_norm, swiglu, rope);
- `conv_bn`: Conv2d -> BatchNorm2d (-> ReLU) sites as one conv2d_bn_relu;
- `hf`: transformers integration (AttentionInterface, Llama-style MLPs);
- `record`: record() and tune_for_hardware (the tuning stack only inside it).
"""
