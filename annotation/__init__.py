"""The bridge to Label Studio: sample and render maps, push tasks with pre-annotations, pull labels."""
