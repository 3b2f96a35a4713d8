"""A word list whose every word, preceded by a space, is exactly one token of the embedded tokenizer.

Text built as ``" " + word`` repeated therefore has as many tokens as words, which lets workloads ask
for prompts of a given token length without tokenizing them (``tests/bench`` checks the calibration).
"""

_WORD_TEXT = """
about above absolute access according action actual added address after again allow already also
always angle another anything append archive argument assume attribute audio available avoid back base
because been before begin being below best between binary bits blank block body both bound break
browser buffer build built cache call called cannot canvas case category change character check child
chunk class clear client close code color column command comment common compare compile complete
complex compress compute condition connect connection content context continue convert copy correct
could count create current data date days debug decimal decode default defined delay description
different digest directory display document does done double drive during each effect either element
else empty enable encode entry equal error escape even event every exact example except exception exist
expected explicit expression extension extra fail false feature field file fill filter final find first
flag float follow force form format found frame from frozen full function give given global group hand
handle handler happen hard hash have head header heading heap help helper here host hour ident ignore
import include indent index information initial input insert inspect instance instead integer
interface internal into invalid issue item itself join just keep kind know known large last leading
least left length level like limit line link list literal little load local lock long look lookup loop
machine magic mail main make many mapping mark match mean member memory message method might missing
mode module month more most must name named names need negative network never newline next node normal
nothing number object offset once only open operation operator option optional order origin original
other otherwise output over package pair parameter parent parse part partial pass password path
pattern pick pipe place platform point port position positive possible prefix present previous print
prior process program prompt proper protocol provide public purpose push queue quiet quote raise random
range read reader ready real reason register regular relative release remote remove replace report
request required reset response rest result return right root round running same sample save scan
screen script search second section seek seen select send sent separator sequence server session
setting shape shell short should show side sign signal similar simple since single site size skip
small socket some sort source space special specific speed split stack standard start state statement
status step still stop store stream strict string strip subclass success such suffix super support sure
syntax system table tail take target tell test text than that their them then there these they thing
this those thread through time timeout timer title token total trace tree true tuple type under unique
unknown unless until update usage used useful user using valid value variable version very visit wait
want week were what when where whether which while width will with within without word work would wrap
write written year yield your zero
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
