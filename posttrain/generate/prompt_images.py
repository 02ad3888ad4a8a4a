"""The images of `posttrain generate --image` in its prompt: read with the model folder's processor settings and
placed in the text and ids as the family's processor places them (Qwen3-VL, Gemma 3), with the Sampler's
`ImageInputs`. What it is not: the data path's image rows (`data/images.py`) or the Sampler's prefill
(`generate/vision.py`)."""

from __future__ import annotations

from posttrain.errors import PosttrainError


class PromptImages:
    """`posttrain generate --image`: the images read with the folder's processor settings and put in the prompt as the
    family's processor puts them. Qwen3-VL: <|vision_start|><|image_pad|><|vision_end|> per image, each <|image_pad|>
    then repeated to its image's token count (Qwen3VLProcessor); Gemma 3: <start_of_image> per image (what its chat
    template writes for an image part), each then replaced in the text by "\\n\\n" <start_of_image>,
    mm_tokens_per_image <image_soft_token>, <end_of_image> "\\n\\n" before tokenising (Gemma3Processor)."""

    def __init__(self, model: str, paths: list, tok, *, text_only: bool = False):
        from posttrain.generate import ImageInputs
        from posttrain.models.hf import load_vision_config
        from posttrain.vision import processor_settings
        from posttrain.vision.qwen_vl import VisionConfig

        self.vcfg = vcfg = None if text_only else load_vision_config(model)
        self.gemma3 = hasattr(vcfg, "mm_tokens_per_image")
        if not (self.gemma3 or isinstance(vcfg, VisionConfig)):
            raise PosttrainError(f"--image: {model} is not a vision-language folder posttrain samples images "
                                 "with (Qwen3-VL, Gemma 3), or was loaded with --text-only")
        settings = processor_settings(model)
        names = {i: t for t, i in tok.get_vocab().items()}
        if self.gemma3:
            from posttrain.data.images import image_spec

            image_spec(settings, vcfg)  # pan-and-scan, the image size and tokens per image against config.json
            ids = (vcfg.boi_token_id, vcfg.image_token_id, vcfg.eoi_token_id)
        else:
            ids = (vcfg.vision_start_token_id, vcfg.image_token_id, vcfg.vision_end_token_id)
        if any(i not in names for i in ids):
            raise PosttrainError(f"--image: the tokenizer of {model} has no token for the image ids {ids} of "
                                 "its config.json; use the tokenizer files of the same checkpoint")
        self.count = len(paths)
        if self.gemma3:
            self.grids, pixels = None, settings.pixels(paths)
            boi, image, eoi = (names[i] for i in ids)
            self.placeholder = boi
            self.sequence = f"\n\n{boi}{image * vcfg.mm_tokens_per_image}{eoi}\n\n"
        else:
            pixels, self.grids = settings.pixels(paths)
            self.placeholder = "".join(names[i] for i in ids)
        self.inputs = ImageInputs(grids=self.grids, pixels=pixels)

    def prompt(self, text: str) -> str:
        """The prompt with each `<image>` replaced by the image placeholder (all before the text when none)."""
        from posttrain.generate.vision import image_prompt

        return image_prompt(text, self.count, self.placeholder)

    def expand_text(self, text: str) -> str:
        """Gemma 3: every <start_of_image> of the (rendered) text replaced by the processor's image sequence."""
        if not self.gemma3:
            return text
        found = text.count(self.placeholder)
        if found != self.count:
            raise PosttrainError(f"--image: the prompt holds {found} {self.placeholder} but {self.count} images "
                                 f"were given; give one image per {self.placeholder} (or per <image>)")
        return text.replace(self.placeholder, self.sequence)

    def expand_ids(self, ids: list) -> list:
        """Qwen-VL: each <|image_pad|> repeated to its image's token count."""
        if self.gemma3:
            return ids
        from posttrain.generate import expand_image_tokens
        from posttrain.vision import qwen_vl_image_tokens

        return expand_image_tokens(ids, self.vcfg.image_token_id,
                                   qwen_vl_image_tokens(self.grids, self.vcfg.spatial_merge_size))
