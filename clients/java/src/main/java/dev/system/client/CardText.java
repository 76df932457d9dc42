package dev.system.client;

import dev.system.common.v1.AgentResult;
import dev.system.common.v1.Card;
import dev.system.common.v1.CardButton;
import dev.system.common.v1.CardLine;
import dev.system.common.v1.HistoryEntry;
import dev.system.common.v1.HistoryRole;
import dev.system.common.v1.ResultStatus;
import dev.system.gateway.v1.PlayerResponse;
import dev.system.gateway.v1.State;
import java.util.ArrayList;
import java.util.List;

/**
 * Cards and responses as chat text, the way the Python simulated game server shows them
 * (services/gamesim/render.py). A real plugin renders cards as chat components or a GUI, with
 * lines that suggest their command when clicked and numbered buttons.
 */
public final class CardText {
  private CardText() {}

  /** A card as text: title, body lines, numbered buttons. */
  public static String render(Card card) {
    List<String> lines = new ArrayList<>();
    lines.add("┌─ " + card.getTitle());
    for (CardLine line : card.getLinesList()) {
      lines.add("│ " + line.getText());
    }
    if (card.getButtonsCount() > 0) {
      List<String> buttons = new ArrayList<>();
      int i = 1;
      for (CardButton b : card.getButtonsList()) {
        buttons.add("[" + i++ + "] " + b.getLabel());
      }
      lines.add("│ " + String.join("  ", buttons));
    }
    lines.add("└─");
    return String.join("\n", lines);
  }

  /** A result: its card (or text), and the failure key when it failed. */
  public static String render(AgentResult result) {
    String text = result.hasCard() ? render(result.getCard()) : result.getText();
    String status = null;
    if (result.getStatus() == ResultStatus.RESULT_STATUS_FAILED) {
      status = "failed";
    } else if (result.getStatus() == ResultStatus.RESULT_STATUS_PARTIALLY_SUCCEEDED) {
      status = "partly done";
    }
    if (status != null && !result.getFailure().getKey().isEmpty()) {
      text += "\n(" + status + ": " + result.getFailure().getKey() + ")";
    }
    return text;
  }

  /** Any player response as text. */
  public static String render(PlayerResponse response) {
    switch (response.getBodyCase()) {
      case REPLY:
        return render(response.getReply().getResult());
      case NOTICE:
        return render(response.getNotice().getResult());
      case STATE: {
        State s = response.getState();
        return "state: " + (s.getBusy() ? "busy" : "idle")
            + ", history " + (s.getHistoryEnabled() ? "on" : "off")
            + ", external services " + (s.getExternalEnabled() ? "on" : "off");
      }
      case HISTORY: {
        if (response.getHistory().getEntriesCount() == 0) {
          return "(no history)";
        }
        List<String> lines = new ArrayList<>();
        for (HistoryEntry e : response.getHistory().getEntriesList()) {
          String who = e.getRole() == HistoryRole.HISTORY_ROLE_PLAYER ? "you"
              : e.getRole() == HistoryRole.HISTORY_ROLE_ASSISTANT ? "assistant" : "?";
          String first = e.getText().isEmpty() ? "" : e.getText().split("\n", 2)[0];
          lines.add(who + ": " + first);
        }
        return String.join("\n", lines);
      }
      case OPEN:
        return "(open view " + response.getOpen().getNavigation().name() + ")";
      case BINDING:
        return "(binding " + response.getBinding().getChange().name() + ")";
      default:
        return "(empty response)";
    }
  }
}
