"""Deprecated alias of `metrale.speculative`, kept only for `metrale.spec.drafter.Drafter`, the
plug-in protocol users may have imported. New code imports `metrale.Drafter` or
`metrale.speculative.drafter`."""
